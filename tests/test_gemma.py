"""The Gemma family (``--model gemma``): Gemma 1, 2 and 3 (text) read from either form of ``config.json``
transformers writes, written back as their own model type, every field meshkit does not compute refused
in one line by its name, the scanned form and the pipeline's blocks of whole periods computing the loop
form's logits, and trained under the plans (certificates: float64 equal to one device, the ledger equal
to the model). A run from a Gemma checkpoint trains, exports as its model type and generates.

The transformers side (logits, greedy generation, exports loading there) is test_hf_gemma.py."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from _tiers import tiered
from meshkit import interop, verify
from meshkit.interop.hf import InteropError, config_from_hf, config_to_hf
from meshkit.models import gemma, gpt, registry
from meshkit.spec import ParallelSpec, PlanError, get_plan

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}  # fmt: skip
CONFIGS = {
    "gemma2": {**BASE, "model_type": "gemma2", "sliding_window": 16, "query_pre_attn_scalar": 16},
    "gemma3": {**BASE, "model_type": "gemma3_text", "sliding_window": 16, "sliding_window_pattern": 2,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "gemma": {**BASE, "model_type": "gemma", "hidden_act": "gelu_pytorch_tanh"},
}  # fmt: skip


def _v5(data: dict) -> dict:
    """A 4.x config.json in transformers 5.x's form: the rotary in ``rope_parameters`` (Gemma 3's keyed by
    layer type, its local base among them), ``dtype``."""
    out = {k: v for k, v in data.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq", "torch_dtype")}  # fmt: skip
    glob = {"rope_type": "default"} if data.get("rope_scaling") is None else dict(data["rope_scaling"])
    glob["rope_theta"] = data.get("rope_theta", 1e6 if data["model_type"] == "gemma3_text" else 10000.0)
    if data["model_type"] != "gemma3_text":
        return out | {"rope_parameters": glob, "dtype": "float32"}
    local = {"rope_type": "default", "rope_theta": data.get("rope_local_base_freq", 10000.0)}
    return out | {"rope_parameters": {"full_attention": glob, "sliding_attention": local}, "dtype": "float32"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_type_reads_its_switches_and_writes_its_own_model_type(name, tmp_path):
    data = CONFIGS[name]
    cfg = config_from_hf(data)
    assert (cfg.sandwich, cfg.qk_norm, cfg.attn_softcap, cfg.final_softcap) == {
        "gemma2": (True, False, 50.0, 30.0), "gemma3": (True, True, None, None), "gemma": (False, False, None, None),
    }[name]  # fmt: skip
    assert cfg.kinds == ((True, False) * 2 if name != "gemma" else (False,) * 4)
    assert (cfg.rope_theta, cfg.rope_factor, cfg.local_rope_theta) == (
        (1e6, 8.0, 10000.0) if name == "gemma3" else (10000.0, 1.0, 0.0)
    )
    assert cfg.query_scalar == (16.0 if name == "gemma2" else 256.0 if name == "gemma3" else 8.0)
    written = config_to_hf(cfg)
    assert written["model_type"] == data["model_type"] and config_from_hf(written) == cfg
    assert config_from_hf(_v5(data)) == cfg == config_from_hf(_v5(written))
    params = jax.tree.map(lambda a: a + 0.5, gemma.init(jax.random.key(0), cfg))
    interop.save(params, cfg, tmp_path / name)
    loaded, read = interop.load(tmp_path / name)
    assert read == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


G2, G3 = CONFIGS["gemma2"], CONFIGS["gemma3"]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({**G3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: transformers' Gemma 3 does not apply it"),
        ({**CONFIGS["gemma"], "hidden_act": "gelu"}, "hidden_act='gelu' is exact GELU in transformers 4.x"),
        ({**G2, "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({**G2, "use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({**G2, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling={'rope_type': 'yarn'"),
        ({**G3, "rope_scaling": {"rope_type": "linear"}}, "rope_type linear takes exactly factor"),
        ({**G3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "is not keyed by layer type"),
        ({**G3, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention is scaled"),
        ({**G2, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "give one of the two forms"),
        ({**G2, "layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types="),
        ({**G2, "layer_types": ["sliding_attention"] * 3}, "per layer of 4"),
        ({**G2, "sliding_window": None}, "sliding_window=None with sliding_attention layers"),
        ({**G2, "attention_bias": True}, "attention_bias=True"),
        ({**G2, "quantization_config": {"quant_method": "awq"}}, "quantization_config="),
        ({**CONFIGS["gemma"], "sliding_window": 16}, "sliding_window=16 is not a field meshkit's Gemma (gemma) reads"),
        ({**G2, "rope_local_base_freq": 100.0}, "rope_local_base_freq=100.0 is not a field meshkit's Gemma (gemma2)"),
    ],
)  # fmt: skip
def test_a_field_meshkit_does_not_compute_is_refused_in_one_line_by_its_name(data, says):
    with pytest.raises(InteropError) as e:
        config_from_hf(data)
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_fields_that_change_no_output_are_read_and_transformers_defaults_apply():
    """Gemma 2 and 3 read ``hidden_activation`` (``hidden_act`` is left aside), Gemma 2's first release's
    ``sliding_window_size`` and the generation's ``cache_implementation`` change nothing; a config that
    omits Gemma 2's caps has transformers' 50 and 30, not none."""
    extra = {
        "hidden_act": "gelu",
        "sliding_window_size": 4096,
        "cache_implementation": "hybrid",
        "use_cache": True,
    }
    assert config_from_hf({**G2, **extra}) == config_from_hf(G2)
    assert config_from_hf(
        {**G3, "_sliding_window_pattern": 6, "use_bidirectional_attention": None}
    ) == config_from_hf(G3)
    explicit = {**G2, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
    assert config_from_hf(explicit) == config_from_hf(G2)


def test_a_config_no_hugging_face_type_computes_is_refused_when_written():
    cfg = dataclasses.replace(config_from_hf(G3), attn_softcap=50.0)
    with pytest.raises(InteropError, match="with an attention soft cap is no Hugging Face model type"):
        config_to_hf(cfg)
    with pytest.raises(InteropError, match="without sandwich norms and with q/k norms"):
        config_to_hf(dataclasses.replace(config_from_hf(CONFIGS["gemma"]), qk_norm=True))


#: The fields of the Hub's config.json of gemma-2-9b and gemma-3-1b-pt and of gemma-3-4b's text model (sizes
#: made tiny): the strict field check refuses none of them.
HUB = {
    "gemma-2-9b": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
                   "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 8, "hidden_act": "gelu_pytorch_tanh",
                   "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "initializer_range": 0.02,
                   "intermediate_size": 64, "max_position_embeddings": 8192, "model_type": "gemma2",
                   "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": 0,
                   "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
                   "sliding_window_size": 4096, "torch_dtype": "float32", "transformers_version": "4.42.0.dev0",
                   "use_cache": True, "vocab_size": 64},
    "gemma-3-1b-pt": {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                      "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
                      "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 8,
                      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "initializer_range": 0.02,
                      "intermediate_size": 64, "max_position_embeddings": 32768, "model_type": "gemma3_text",
                      "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
                      "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
                      "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
                      "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
                      "vocab_size": 64},
    "gemma-3-4b-text": {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 34,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
}  # fmt: skip


@pytest.mark.parametrize("name", list(HUB))
def test_the_hubs_own_configs_are_read(name):
    """Gemma 3's 26 and 34 layers are not whole periods of its pattern of 6: the scanned form runs them
    (each layer's kind scanned), a pipeline refuses them."""
    cfg = config_from_hf(HUB[name])
    assert (
        cfg.tie_embeddings
        and cfg.window == {"gemma-2-9b": 4096, "gemma-3-1b-pt": 512, "gemma-3-4b-text": 1024}[name]
    )
    assert cfg.period == (2 if name == "gemma-2-9b" else 6)
    assert (cfg.rope_factor, cfg.local_rope_theta) == (
        {"gemma-2-9b": (1.0, 0.0), "gemma-3-1b-pt": (1.0, 10000.0), "gemma-3-4b-text": (8.0, 10000.0)}[name]
    )


def _by_stages(cfg, params, tokens):
    """The logits ``gemma.stages`` computes: embedding, ``run_blocks`` (whole periods), head."""
    stages, top = gemma.stages(cfg), {k: v for k, v in params.items() if k != "blocks"}
    assert stages.period == cfg.period
    return np.asarray(stages.head(top, stages.run_blocks(params["blocks"], stages.embed(top, (tokens,)))))


@pytest.mark.parametrize("layers", [5, 6])
def test_the_scanned_form_and_whole_periods_of_stages_compute_the_loop_forms_logits(layers):
    """Gemma 3's pattern of 3 (two local layers, one global) over 5 and 6 layers: the scanned form scans
    every layer with its kind beside its parameters; the pipeline's ``Stages`` scan whole periods, so
    they take 6 layers and refuse 5 in one line naming the period."""
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 40)).astype(np.int32)
    cfg = config_from_hf({**G3, "num_hidden_layers": layers, "sliding_window_pattern": 3, "sliding_window": 6,
                          "rope_local_base_freq": 100.0, "final_logit_softcapping": 2.0})  # fmt: skip
    params = jax.tree.map(lambda a: 5 * a + 0.1, gemma.init(jax.random.key(layers), cfg))
    want = np.asarray(gemma.apply(params, tokens, cfg))
    scanned, scfg = gpt.to_form(params, True), dataclasses.replace(cfg, scan_layers=True)
    assert cfg.period == 3 and np.max(np.abs(np.asarray(gemma.apply(scanned, tokens, scfg)) - want)) < 1e-5
    if layers == 5:
        with pytest.raises(PlanError, match="5 layers are not whole periods of 3"):
            _by_stages(scfg, scanned, tokens)
    else:
        assert np.max(np.abs(_by_stages(scfg, scanned, tokens) - want)) < 1e-5


def test_a_pipeline_of_stages_holding_parts_of_a_period_is_refused_by_its_sizes():
    from meshkit.train import Trainer

    cfg = registry.family("gemma").small(layers=2, heads=4, experts=0, scan_layers=True)
    params = gemma.init(jax.random.key(0), cfg)
    with pytest.raises(
        PlanError, match=r"give each stage 1, not whole periods of 2 .* use a stage axis of 1, 2"
    ):
        Trainer(gemma.stages(cfg), params, optax.adam(1e-2), plan="dp+pp", mesh="stage=4,data=2", microbatches=4,
                logical_axes=gemma.logical_axes(params))  # fmt: skip


def _certificate(cfg, plan, mesh, opts):
    """``meshkit.verify``'s certificate of ``cfg`` under the plan, as test_families' for the Llama."""
    from meshkit.verify.certificate import _certify
    from meshkit.verify.reference import shared_reference
    from meshkit.verify.workloads import _family

    pipeline = get_plan(plan).pipeline
    cfg = dataclasses.replace(cfg, scan_layers=pipeline)
    w = _family(
        "gemma", registry.family("gemma"), cfg, np.random.default_rng(0), jax.random.key(0), stages=pipeline
    )
    spec = ParallelSpec(plan=plan, mesh=mesh, **opts)
    # one reference per config and form, shared by the plans of this file that certify it
    ref = shared_reference(
        ("tests", "gemma", repr(cfg), pipeline, "adam", 1e-2, 2), w, optax.adam(1e-2), 2, 1e-2
    )
    return _certify(w, optax.adam(1e-2), spec, 2, ref)


#: (plan, mesh, options): ZeRO-3, the heads and the vocabulary split, a pipeline of whole periods, the
#: sequence split (Gemma 2's capped scores in the ring's blocks, Gemma 3's all-to-all). The ring runs on
#: context=4 (blocks of 4 of the 16 positions, the window of 8 two blocks): on context=8 the same masks
#: cost 48 CPU seconds, the suite's dearest certificate.
RING, ALL_TO_ALL = {"context_attention": "ring"}, {"context_attention": "all-to-all"}
PLANS = [
    ("fsdp", "data=8", {}),
    ("tp", "model=8", {}),
    ("dp+pp", "stage=2,data=4", {"microbatches": 4}),
    ("dp+cp", "data=2,context=4", RING),
    ("dp+cp", "data=2,context=4", ALL_TO_ALL),
]
GEMMA3 = {**G3, "num_attention_heads": 8, "max_position_embeddings": 16, "sliding_window": 6,
          "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
          "query_pre_attn_scalar": 12}  # fmt: skip


CERTIFIED = [("gemma2", *p) for p in PLANS if p[-1] is not ALL_TO_ALL] + [
    ("gemma3", *p) for p in PLANS if p[-1] is not RING
]
"""Each type under each plan, one context form each."""


# Tiers: gemma3-tp is core (Gemma 2, meshkit verify's small Gemma, is core in the verify cases below and
# trained from its checkpoint below; beside transformers in test_hf_gemma.py, a sweep); all-to-all is core
# in the verify case gemma-scan-dp+cp below, the ring's capped blocks in test_attention.py, pipelines of
# whole periods in test_the_scanned_form_and_whole_periods_of_stages_compute_the_loop_forms_logits[6]; the
# rest sweep.
@pytest.mark.parametrize(
    ("kind", "plan", "mesh", "opts"),
    tiered(
        CERTIFIED,
        ids=[f"{c[0]}-{c[1]}" + ("-ring" if c[-1] is RING else "") for c in CERTIFIED],
        core={"gemma3-tp"},
    ),
)
def test_gemma_trains_under_the_plans_as_on_one_device(kind, plan, mesh, opts):
    """Gemma 2: ``meshkit verify``'s own small Gemma (``Family.small``: local and global layers, a window
    of 8 of 16 positions, caps that bind), its key/value heads 8 under tp on model=8 (4 would stay whole
    on the model axis, which the ledger's model of tp does not count, as for the Llama). Gemma 3: q/k
    norms (replicated), a local rotary base, a linear global one, a window of 6."""
    heads = 8
    if kind == "gemma2":
        cfg = registry.family("gemma").small(layers=2, heads=heads, experts=0, scan_layers=False)
    else:
        cfg = config_from_hf(GEMMA3)
    if plan == "tp":
        cfg = dataclasses.replace(cfg, kv_heads=heads)
    cert = _certificate(cfg, plan, mesh, opts)
    print(f"{kind} {plan}: float64 vs one device {cert.exact_vs_single_device:.1e}")
    assert cert.ok, str(cert)


#: ``meshkit verify --model gemma --plan fsdp`` (the loop form) is the certificate of
#: test_gemma_trains_under_the_plans_as_on_one_device[gemma2-fsdp]: the same workload (``Family.small``,
#: seed 0), plan, mesh, 2 steps and optimizer through the same ``_certify`` (it was a case here too: the
#: same certificate twice, 12 CPU seconds).
# Tiers: gemma-scan-cp sweeps: the capped scores in the ring's blocks are core in test_attention.py's
# test_each_plan_caps_the_scores_as_one_device[cp], scanned windows on the ring in its
# test_a_window_in_some_scanned_layers_only_attends_as_their_loop_and_keeps_collectives_unconditional.
VERIFIED = [("gemma-scan", "fsdp", "data=8", {}), ("gemma-scan", "cp", "context=8", {}),
            ("gemma-scan", "dp+cp", "data=2,context=4", {"context_attention": "all-to-all"})]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "plan", "mesh", "opts"),
    tiered(VERIFIED, [f"{v[0]}-{v[1]}" for v in VERIFIED], core={"gemma-scan-fsdp", "gemma-scan-dp+cp"}),
)
def test_meshkit_verify_takes_the_gemma_and_zero3_gathers_its_scanned_layers_one_by_one(
    model, plan, mesh, opts
):
    """``meshkit verify --model gemma-scan`` (its small model, 2 pairs of layers) certifies fsdp (the
    loop form's fsdp certificate: see ``VERIFIED``): each layer's kind scanned beside its parameters,
    they stay a scan's inputs, which ZeRO-3 finds and gathers layer by layer; under a context split the
    scanned form's choice of window leaves the collectives unconditional, so the ledger is the model's."""
    cert = verify.verify(plan, model, mesh=mesh, steps=2, **opts)
    assert cert.ok and cert.exact_vs_single_device < 1e-10, str(cert)
    if (model, plan) == ("gemma-scan", "fsdp"):
        from meshkit.train import Trainer

        w = verify.workload(model)
        t = Trainer(
            w.loss_fn, w.params, optax.adam(1e-2), plan="fsdp", mesh="data=8", logical_axes=w.logical_axes
        )
        t.step(w.batch)
        assert (t.per_layer.found.mode, t.per_layer.found.layers) == ("scan", 4), t.per_layer.found.note


def test_a_run_from_a_gemma2_checkpoint_trains_exports_as_gemma2_and_generates(tmp_path):
    """``--init-from hf:DIR`` with a Gemma 2 checkpoint: the run's model is the checkpoint's (its window,
    caps and weights), ``meshkit export`` writes it back as model_type gemma2, and ``meshkit generate``
    continues a prompt with a key/value cache over its local and global layers."""
    import io
    import json

    from rich.console import Console

    from meshkit.data import load
    from meshkit.models.generate import Sampling
    from meshkit.train import config as C
    from meshkit.train.job import prepare
    from meshkit.train.loop import train
    from meshkit.train.outputs import export_run, generate_text, load_run

    data = load(C.tiny().data.data)
    model = config_from_hf({**G2, "vocab_size": len(data.chars), "num_hidden_layers": 2, "sliding_window": 8})
    interop.save(gemma.init(jax.random.key(1), model), model, tmp_path / "ckpt", vocab=data.chars)
    cfg = C.tiny().replace(model="gemma", layers=2, width=32, heads=4, kv_heads=2, tie_embeddings=True, plan="dp",
                           steps=2, eval_every=0, init_from=f"hf:{tmp_path / 'ckpt'}", run_dir=str(tmp_path / "run"))  # fmt: skip
    job = prepare(cfg)
    assert dataclasses.replace(job.model, compute_dtype=None) == model
    assert train(job, Console(file=io.StringIO()))
    (tmp_path / "run" / "config.json").write_text(C.dumps(cfg))
    export_run(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gemma2"
    assert interop.read_config(tmp_path / "out") == model
    (text,) = generate_text(load_run(tmp_path / "run"), ["the "], 5, sampling=Sampling())
    assert len(text) == 5
