"""Reference models: plain pytrees and pure functions. Models never see the mesh."""

from meshkit.models import mlp

__all__ = ["mlp"]
