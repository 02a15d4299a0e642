#!/bin/sh
# A throwaway CA and one certificate for the processes of a local job (the README's worked example),
# and a second, unrelated CA with its own certificate (an outsider). Usage: make_pki.sh DIR
set -eu
cd "$1"
# 1. The job's CA: its key never leaves the machine that signs.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=meshkit job CA" \
  -keyout ca.key -out ca.crt 2>/dev/null
# 2. A certificate for the job's processes, naming the coordinator's host (clients check it),
#    usable as server (process 0's coordination service) and client (every process).
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > node.ext
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout node.key -out node.csr 2>/dev/null
openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
  -extfile node.ext -out node.crt 2>/dev/null
# An outsider: a certificate just as valid, but signed by another CA.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=other CA" \
  -keyout other-ca.key -out other-ca.crt 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout outsider.key -out outsider.csr 2>/dev/null
openssl x509 -req -in outsider.csr -CA other-ca.crt -CAkey other-ca.key -CAcreateserial -days 2 \
  -extfile node.ext -out outsider.crt 2>/dev/null
chmod 600 ./*.key
