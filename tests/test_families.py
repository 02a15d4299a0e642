"""The Llama family's other decoders (issue 36): Llama 3.1's rotary scaling, Qwen2's q/k/v biases and
Qwen3's per-head q/k norms, read from either form of ``config.json`` transformers writes (4.x's
``rope_theta``/``rope_scaling``, 5.x's ``rope_parameters``), written back as their own model type,
every field meshkit does not compute refused by name, and trained under the plans (certificates).

The transformers side (logits, greedy generation, exports loading there) is test_hf_families.py."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _tiers import tiered
from meshkit import interop
from meshkit._errors import MeshkitError
from meshkit.interop.hf import Checkpoint, InteropError, config_from_hf, config_to_hf
from meshkit.models import gpt, llama, registry
from meshkit.models.rope import YarnRope, inv_frequencies
from meshkit.spec import ParallelSpec, get_plan

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8}
"""A Qwen3-MoE's own fields (four experts of width 16, two a token)."""
CONFIGS = {
    "llama3": {**BASE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "qwen2": {**BASE, "model_type": "qwen2", "rope_theta": 1e6, "tie_word_embeddings": True},
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 16, "rope_theta": 1e6},
    "phi3": {
        **BASE,
        "model_type": "phi3",
        "partial_rotary_factor": 0.75,
        "sliding_window": 16,
        "original_max_position_embeddings": 64,
    },
    "olmo2": {**BASE, "model_type": "olmo2", "rope_theta": 5e5},
    "gpt_oss": {**BASE, "model_type": "gpt_oss", "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 16, "rope_theta": 1.5e5, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}},
}  # fmt: skip
SWITCHES = {
    "phi3": {"fused": True, "rotary_dim": 6, "window": 16},
    "olmo2": {"post_norms": True, "qk_norm_whole": True},
    "gpt_oss": {"qkv_bias": True, "o_bias": True, "sinks": True, "wide_norms": True, "moe_bias": True,
                "swiglu_limit": 7.0, "experts": 4, "capacity_factor": 0.0, "router_renormalize": True,
                "router_aux_weight": 0.001, "window": 16, "sliding": (True, False),
                "rope_scaling": YarnRope(factor=32.0, original_positions=4096, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False)},
}  # fmt: skip
"""What the Phi-3's, the OLMo 2's and the GPT-OSS's rows set beyond a Llama's defaults (head_dim 8): the last's
interleaved gate and up written and read back bitwise."""


def _v5(data: dict) -> dict:
    """A 4.x config.json in transformers 5.x's form: the rotary in ``rope_parameters``, ``dtype``."""
    out = {k: v for k, v in data.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    rope = {"rope_type": "default"} if data.get("rope_scaling") is None else dict(data["rope_scaling"])
    return out | {
        "rope_parameters": {"rope_theta": data.get("rope_theta", 10000.0), **rope},
        "dtype": "float32",
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_family_reads_its_switches_and_writes_its_own_model_type(name, tmp_path):
    data = CONFIGS[name]
    cfg = config_from_hf(data)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.rope_scaling is not None) == (
        name in ("qwen2", "gpt_oss"), name == "qwen3", name in ("llama3", "gpt_oss"),
    )  # fmt: skip
    plain = config_from_hf(
        {**BASE, "model_type": "llama", "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps}
    )
    if name in SWITCHES:
        assert cfg == dataclasses.replace(plain, **SWITCHES[name])
    written = config_to_hf(cfg)
    assert written["model_type"] == data["model_type"] and config_from_hf(written) == cfg
    assert config_from_hf(_v5(data)) == cfg == config_from_hf(_v5(written))
    params = jax.tree.map(lambda a: a + 0.5, llama.init(jax.random.key(0), cfg))
    interop.save(params, cfg, tmp_path / name)
    loaded, read = interop.load(tmp_path / name)
    assert read == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


#: (config.json, what meshkit reads of it): windows in every layer or in some, experts read dropless
WINDOWS_AND_EXPERTS = {
    "mistral": ({**BASE, "model_type": "mistral", "sliding_window": 8}, {"window": 8, "sliding": None}),
    "qwen2-max-window-layers": (
        {
            **BASE,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
        {"window": 8, "sliding": (False, True), "qkv_bias": True},
    ),
    "qwen2-layer-types": (
        {
            **BASE,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        {"window": 8, "sliding": (True, False)},
    ),
    "mixtral": (
        {
            **BASE,
            "model_type": "mixtral",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "rope_theta": 1e6,
        },
        {
            "experts": 4,
            "experts_per_token": 2,
            "capacity_factor": 0.0,
            "router_renormalize": True,
            "window": 8,
        },
    ),
    "qwen3_moe": (
        {
            **BASE,
            "model_type": "qwen3_moe",
            **MOE,
            "norm_topk_prob": True,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.02,
        },
        {"experts": 4, "ffn": 16, "qk_norm": True, "router_renormalize": True, "router_aux_weight": 0.02},
    ),
    "qwen3_moe-5x": (  # transformers 5.x writes num_local_experts
        {
            **BASE,
            "model_type": "qwen3_moe",
            **{k: v for k, v in MOE.items() if k != "num_experts"},
            "num_local_experts": 4,
            "router_aux_loss_coef": 0.02,
            "max_window_layers": 1,
        },
        {"experts": 4, "router_renormalize": False, "router_aux_weight": 0.02, "window": None},
    ),
    "qwen3_moe-dense": (  # Qwen3-MoE's rule: a layer is dense where named, or where step does not divide i + 1
        {
            **BASE,
            "model_type": "qwen3_moe",
            **MOE,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "intermediate_size": 40,
        },
        {
            "experts": 4,
            "ffn": 16,
            "dense_layers": (True, False, True, True),
            "dense_ffn": 40,
            "sparse_layers": 1,
        },
    ),
    "qwen2_moe": (  # a shared expert of width 24 beside the routed ones; the Hub's configs carry a window off
        {
            **BASE,
            "model_type": "qwen2_moe",
            **MOE,
            "shared_expert_intermediate_size": 24,
            "qkv_bias": True,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 21,
        },
        {
            "experts": 4,
            "ffn": 16,
            "shared_ffn": 24,
            "qkv_bias": True,
            "router_renormalize": False,
            "window": None,
        },
    ),
}


@pytest.mark.parametrize("name", list(WINDOWS_AND_EXPERTS))
def test_windows_and_experts_read_and_write_as_their_own_model_type(name, tmp_path):
    """Each reads as the model transformers runs, is written back as its own model type (5.x's form of
    it reads the same), and its weights (one tensor per expert) come back bitwise, in both forms."""
    data, want = WINDOWS_AND_EXPERTS[name]
    cfg = config_from_hf(data)
    assert {k: getattr(cfg, k) for k in want} == want
    written = config_to_hf(cfg)
    assert written["model_type"] == data["model_type"] and config_from_hf(written) == cfg
    assert config_from_hf(_v5(data)) == cfg
    params = jax.tree.map(lambda a: a + 0.5, llama.init(jax.random.key(0), cfg))
    interop.save(params, cfg, tmp_path / name)
    loaded, read = interop.load(tmp_path / name)
    assert read == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    if cfg.experts:
        names = interop.hf.Checkpoint(tmp_path / name).names()
        assert sum(".experts.3." in n for n in names) == 3 * cfg.sparse_layers and not any(
            "experts.4" in n for n in names
        )
        if cfg.dense_layers:  # layers of two kinds: no scanned form
            with pytest.raises(
                MeshkitError, match="dense layers between routed ones runs in the layers form only"
            ):
                dataclasses.replace(cfg, scan_layers=True)
            return
        scanned = dataclasses.replace(cfg, scan_layers=True)  # (layers, experts, ...) read tensor by tensor
        stacked, _ = interop.load(tmp_path / name, scanned)
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(gpt.to_scanned(params)), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"dense_layers": (True, False)}, "experts is 0"),
        ({"experts": 4, "dense_layers": (True, True)}, "every layer is dense"),
        ({"experts": 4, "dense_layers": (True,)}, "dense_layers must be 2 booleans"),
        ({"experts": 4, "dense_layers": (True, False), "scan_layers": True}, "runs in the layers form only"),
    ],
)
def test_dense_layers_among_routed_ones_are_checked_in_one_line(kw, says):
    with pytest.raises(MeshkitError, match=says) as e:
        llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, **kw)
    assert "\n" not in str(e.value)


def test_a_window_on_a_type_that_says_it_only_per_layer_is_refused_when_written():
    """Some layers sliding and no Qwen2 biases: no model type holds it (Mistral slides in every layer)."""
    cfg = dataclasses.replace(config_from_hf(CONFIGS["llama3"]), window=8, sliding=(True, False))
    with pytest.raises(
        InteropError, match=r"window=8 \(sliding=\(True, False\)\) is no Hugging Face model type"
    ):
        config_to_hf(cfg)
    assert config_to_hf(dataclasses.replace(cfg, sliding=None))["model_type"] == "mistral"


def test_qwen3_without_head_dim_has_transformers_default_and_llama_hidden_over_heads():
    qwen3 = {k: v for k, v in CONFIGS["qwen3"].items() if k != "head_dim"}
    assert config_from_hf(qwen3).head_dim == 128 and config_from_hf(CONFIGS["qwen2"]).head_dim == 8


def test_the_5x_rope_parameters_are_read_not_ignored():
    """The report of issue 36: ``rope_parameters``' theta gave 10000.0; now it is read, and its
    llama3 scaling with it."""
    data = {**BASE, "model_type": "llama", "rope_parameters": {"rope_theta": 5e5, **LLAMA3}}
    cfg = config_from_hf(data)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == llama.Llama3Rope(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_positions=32
    )


def test_llama3_frequencies_are_transformers_formula():
    """Long wavelengths stretched ``factor`` times, short ones kept, those between interpolated: the
    formula in float64 NumPy, written from the Llama 3.1 paper's description, against meshkit's."""
    rope = {**LLAMA3, "original_max_position_embeddings": 64}  # wavelengths 6.3 (kept), 32 (between), 168...
    cfg = config_from_hf({**CONFIGS["llama3"], "hidden_size": 64, "rope_scaling": rope})  # head_dim 16
    r = cfg.rope_scaling
    f = 1.0 / cfg.rope_theta ** (np.arange(0, 16, 2) / 16)
    wave = 2 * math.pi / f
    s = np.clip(
        (r.original_positions / wave - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor), 0, 1
    )
    want = (1 - s) * f / r.factor + s * f
    got = np.asarray(inv_frequencies(cfg, np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    kinds = {"kept": wave < r.original_positions / 4, "stretched": wave > r.original_positions}
    assert all(v.any() for v in kinds.values()) and not (kinds["kept"] | kinds["stretched"]).all()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [2.0]}}, "rope_type 'longrope'"),
        ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32}}, "rope_type yarn lacks factor"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}}, "truncate='yes' is not true or false"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}}, "beta_fast"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "original_max_position_embeddings": 32}}, "rope_type linear takes no original_max_position_embeddings"),
        ({"rope_scaling": {**LLAMA3, "factor": None}}, "rope_scaling="),
        ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}}, "lacks low_freq_factor"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, "high_freq_factor > low_freq_factor"),
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "lacks high_freq_factor"),
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default", "partial_rotary_factor": 0.5}}, "takes no partial_rotary_factor"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters="),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, "give one of the two forms"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config="),
        ({"model_type": "qwen2", "layer_types": ["full_attention", "chunked_attention"]}, "layer_types="),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"]}, "give 2 layers"),
        ({"model_type": "mistral", "sliding_window": 16, "layer_types": ["sliding_attention"] * 2}, "layer_types="),
        ({"model_type": "mistral", "sliding_window": 16, "max_window_layers": 1}, "max_window_layers=1"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 is not a whole number of tokens"),
        ({"model_type": "qwen3_moe", **MOE, "layer_types": ["sliding_attention"] * 2}, "layer_types="),
        ({"sliding_window": 16}, "sliding_window=16 in a LlamaForCausalLM config"),
        ({"model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 3}, "decoder_sparse_step=3, mlp_only_layers=[] make every layer a dense MLP"),
        ({"model_type": "qwen3_moe", **MOE, "mlp_only_layers": [0, 1]}, "make every layer a dense MLP"),
        ({"model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"model_type": "qwen3_moe", **MOE, "num_local_experts": 8}, "num_experts=4, num_local_experts=8 differ"),
        ({"model_type": "qwen3_moe", **MOE, "shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size=16"),
        ({"model_type": "qwen3_moe", **MOE, "num_experts": 0}, "num_experts=0"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"model_type": "qwen2_moe", **MOE, "shared_expert_intermediate_size": 8, "qkv_bias": False}, "qkv_bias=False"),
        ({"model_type": "qwen2_moe", **MOE, "shared_expert_intermediate_size": 8, "use_sliding_window": True}, "use_sliding_window=true in a Qwen2MoeForCausalLM"),
        ({"model_type": "qwen2_moe", **MOE}, "shared_expert_intermediate_size"),
        ({"model_type": "deepseek_v3", **MOE}, "model_type 'deepseek_v3'"),
        ({"model_type": "phi3", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "takes longrope only"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, "partial_rotary_factor differs"),
        ({"model_type": "phi3", "partial_rotary_factor": 1.5}, "turns more than a head"),
        ({"model_type": "phi3", "resid_pdrop": 0.1}, "resid_pdrop=0.1"),
        ({"model_type": "olmo2", "attention_bias": True}, "attention_bias=True"),
        ({"model_type": "olmo2", "sliding_window": 16}, "sliding_window=16 in a Olmo2ForCausalLM config"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)  # fmt: skip
def test_a_field_meshkit_does_not_compute_is_refused_in_one_line_by_its_name(extra, says):
    with pytest.raises(InteropError) as e:
        config_from_hf({**BASE, "model_type": "llama", **extra})
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
        {"model_type": "qwen2", "layer_types": ["full_attention"] * 2, "sliding_window": None},
        {"model_type": "qwen2", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
        {"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
        {"pretraining_tp": 1, "use_cache": True, "initializer_range": 0.02, "transformers_version": "5.0.0"},
        {
            "model_type": "phi3",
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0},
        },
        {"model_type": "phi3", "partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096},
    ],
)
def test_fields_that_do_not_change_the_model_are_read(extra):
    kind = extra.get("model_type", "llama")
    assert config_from_hf({**BASE, "model_type": "llama", **extra}) == config_from_hf(
        {**BASE, "model_type": kind}
    )


def test_a_config_with_both_switches_is_no_hugging_face_type():
    cfg = dataclasses.replace(config_from_hf(CONFIGS["qwen2"]), qk_norm=True)
    with pytest.raises(InteropError, match=r"qkv_bias=True, qk_norm=True, .* is no Hugging Face model type"):
        config_to_hf(cfg)


def _certificate(cfg, plan, mesh, opts):
    """``meshkit.verify``'s certificate of ``cfg`` under the plan: its workload is a family's
    (``verify.workloads``), with this config in place of the family's small one."""
    from meshkit.verify.certificate import _certify
    from meshkit.verify.reference import shared_reference
    from meshkit.verify.workloads import _family

    pipeline = get_plan(plan).pipeline
    cfg = dataclasses.replace(cfg, scan_layers=pipeline)
    w = _family(
        "llama", registry.family("llama"), cfg, np.random.default_rng(0), jax.random.key(0), stages=pipeline
    )
    spec = ParallelSpec(plan=plan, mesh=mesh, **opts)
    # one reference per config and form, shared by the plans of this file that certify it
    ref = shared_reference(
        ("tests", "llama", repr(cfg), pipeline, "adam", 1e-2, 2), w, optax.adam(1e-2), 2, 1e-2
    )
    return _certify(w, optax.adam(1e-2), spec, 2, ref)


SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 16}  # fmt: skip
#: (plan, mesh, options, key/value heads): under tp on model=8 the key/value heads are 8 as well (2 would
#: stay whole on the model axis, which the ledger's model of tp does not count)
PLANS = [
    ("fsdp", "data=8", {}, 2),
    ("tp", "model=8", {}, 8),
    ("dp+pp", "stage=2,data=4", {"microbatches": 4}, 2),
]


QWEN = [(kind, *p) for p in PLANS for kind in ("qwen2", "qwen3")]


# Tiers (this file): the Qwen2 under tp is core (plan tp's certificate on the Llama family, its biases split);
# the Qwen3 under tp sweeps (per-head q/k norms replicated under a model axis are core in test_gemma.py's
# gemma3-tp, the Llama family's per-head norms against transformers in test_hf_families.py's hf-glm4-moe);
# the other plans of each family
# sweep (each plan is core with the GPT and the Llama), and so does the Mixtral under every expert plan (see
# test_an_imported_mixture_trains_under_the_expert_plans_as_on_one_device).
# Qwen2's windows sweep under every plan: a window under all-to-all is core in test_attention.py's
# test_each_plan_attends_as_one_device_masks_included[dp+cp], in the ring's blocks in its scanned windows on
# cp, windows that differ by layer and a pipeline's refusal of them in test_llama_window.py
# (test_layers_of_different_windows_run_in_the_loop_form_and_are_refused_scanned). Mistral's window under
# dp+pp sweeps too: a window in a pipeline's blocks is core in test_attention.py's
# test_each_plan_attends_as_one_device_masks_included[dp+pp] (float64, einsum and fused), the Llama's
# blocks with a window in every layer in test_layers_of_different_windows_run_in_..., llama.stages under
# dp+pp in test_packing.py's llama-dp+pp-stage=2,data=4 and test_lora.py's dp+pp, a pipeline's certificate
# (its schedule and ledger against the model) in test_verify.py's
# test_the_issues_pp_plan_on_8_stages_is_certified_by_a_derived_float32_bound.
@pytest.mark.parametrize(
    ("kind", "plan", "mesh", "opts", "kv"),
    tiered(QWEN, [f"{c[1]}-{c[0]}" for c in QWEN], core={"tp-qwen2"}),
)
def test_qwen_trains_under_the_plans_as_on_one_device(kind, plan, mesh, opts, kv):
    """Biases split as their weights' output dim (``heads``, ``kv_heads``), per-head norms replicated."""
    cfg = config_from_hf({**SMALL, "model_type": kind, "head_dim": 8, "num_key_value_heads": kv})
    params = llama.init(jax.random.key(0), cfg)
    axes = llama.logical_axes(params)["blocks"][0]["attn"]
    assert (axes.get("bq"), axes.get("bk"), axes.get("q_norm")) == (
        (("heads",), ("kv_heads",), None) if kind == "qwen2" else (None, None, (None,))
    )
    cert = _certificate(cfg, plan, mesh, opts)
    assert cert.ok, str(cert)


OTHERS = [
    ("olmo2", "tp", "model=8", {}, 8),
    ("olmo2", "fsdp", "data=8", {}, 2),
    ("olmo2", "tp", "model=8", {"remat": "layer"}, 8),
    ("olmo2", "fsdp+tp", "data=2,model=4", {"sequence_parallel": True}, 4),
    ("olmo2", "tp+pp", "stage=2,model=4", {"microbatches": 4, "remat": "layer"}, 4),
    ("phi3", "tp", "model=8", {}, 8),
    ("phi3", "fsdp", "data=8", {}, 2),
]
"""(family, plan, mesh, options, key/value heads) of the rows whose blocks differ from the Llama's."""


# Tiers: the OLMo 2 under tp is core (its norms over the heads' whole width split with the heads, their
# statistics summed over the model axis in the ledger); its other plans and the Phi-3's sweep (the Phi-3's
# partial rotary and fused tensors are core in test_hf_families.py's hf-phi3, its LoRA in test_lora.py).
@pytest.mark.parametrize(
    ("kind", "plan", "mesh", "opts", "kv"),
    tiered(OTHERS, [f"{c[1]}-{c[0]}" + "".join(f"-{k}" for k in c[3]) for c in OTHERS], core={"tp-olmo2"}),
)
def test_olmo2_and_phi3_train_under_the_plans_as_on_one_device(kind, plan, mesh, opts, kv):
    """Equal to one device in float64, and the ledger equals its model: OLMo 2's q/k norm scales split as
    the heads, their statistics all-reduced over the model axis forward and backward (and again where
    remat redoes the layer), its row-parallel outputs, which its norms read, all redone under layer
    remat; the Phi-3's partial rotary under a window."""
    phi = {"partial_rotary_factor": 0.5, "sliding_window": 8} if kind == "phi3" else {}
    cfg = config_from_hf({**SMALL, "model_type": kind, "num_key_value_heads": kv, **phi})
    if kind == "olmo2":
        axes = llama.logical_axes(llama.init(jax.random.key(0), cfg))["blocks"][0]["attn"]
        assert (axes["q_width_norm"], axes["k_width_norm"]) == (("heads",), ("kv_heads",))
    cert = _certificate(cfg, plan, mesh, opts)
    assert cert.ok, str(cert)


def test_olmo2_norms_scale_in_float32_before_the_cast_as_transformers_olmo2_rmsnorm():
    """In bfloat16 ``Olmo2RMSNorm`` computes ``(weight * x_f32 / rms).to(bf16)``; the Llama's casts, then
    scales: over 4096 random rows the two differ, and the OLMo 2's form equals NumPy's float32 bitwise."""
    from ml_dtypes import bfloat16

    from meshkit.models.llama_layers import rms_norm

    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(4096, 32)).astype(bfloat16), (1 + rng.normal(size=32)).astype(bfloat16)
    xf = x.astype(np.float32)
    want = (w.astype(np.float32) * (xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6))).astype(
        bfloat16
    )
    wide = np.asarray(rms_norm({"scale": jnp.asarray(w)}, jnp.asarray(x), 1e-6, wide_scale=True))
    narrow = np.asarray(rms_norm({"scale": jnp.asarray(w)}, jnp.asarray(x), 1e-6))
    assert (
        np.mean(wide.astype(np.float32) != want.astype(np.float32)) < 1e-3
    )  # rsqrt against 1/sqrt: rare ulps
    assert np.mean(narrow.astype(np.float32) != want.astype(np.float32)) > 0.05


def test_the_ledger_reads_the_norms_scales_and_the_products_they_read_from_the_loss():
    """``plans.dataflow`` on the loss's jaxpr: every norm's scale (Qwen3's per-head ones, OLMo 2's over the
    heads' width, the blocks' and the final one), and the matrices whose products a norm squares (the q/k
    projections under either; OLMo 2's ``wo`` and ``w_down``, normalised before the residual sum)."""
    from meshkit.plans import dataflow

    batch = (jax.ShapeDtypeStruct((2, 16), np.int32),) * 2
    found = {}
    for kind in ("qwen3", "olmo2"):
        cfg = config_from_hf({**SMALL, "model_type": kind, "head_dim": 4, "num_hidden_layers": 1})
        flow = dataflow(llama.make_loss(cfg), jax.eval_shape(llama.init, jax.random.key(0), cfg), batch)
        found[kind] = (flow.norm_scales, flow.normed)
    block = {"blocks/0/attn_norm/scale", "blocks/0/mlp_norm/scale", "norm_f/scale"}
    assert found["qwen3"] == (block | {"blocks/0/attn/q_norm", "blocks/0/attn/k_norm"},
                              {"blocks/0/attn/wq", "blocks/0/attn/wk"})  # fmt: skip
    assert found["olmo2"] == (block | {"blocks/0/attn/q_width_norm", "blocks/0/attn/k_width_norm"},
                              {f"blocks/0/{w}" for w in ("attn/wq", "attn/wk", "attn/wo", "mlp/w_down")})  # fmt: skip


WINDOWED = {
    "mistral": {**SMALL, "model_type": "mistral", "sliding_window": 4},
    "qwen2": {**SMALL, "model_type": "qwen2", "head_dim": 4, "use_sliding_window": True, "sliding_window": 4,
              "max_window_layers": 1},
}  # fmt: skip
"""A window of 4 of the 16 positions: in every layer (Mistral's), in the second layer only (Qwen2's)."""
#: the batch split with ZeRO-3, both context forms (the ring's blocks under tensor parallelism,
#: all-to-all's whole sequence), a pipeline. Qwen2's windows differ by layer, which covers Mistral's one
#: window in every layer under the plans that keep a window per layer (the same masks, layer by layer);
#: a pipeline takes only Mistral's. (Mistral under the other plans, and the ring alone on context=8,
#: were 5 certificates and 90 CPU seconds of the suite that tested no other code.)
WINDOW_CASES = [
    ("qwen2", "fsdp", "data=8", {}),
    ("qwen2", "tp+cp", "context=4,model=2", {"context_attention": "ring"}),
    ("qwen2", "dp+cp", "data=2,context=4", {"context_attention": "all-to-all"}),
    ("qwen2", "dp+pp", "stage=2,data=4", {"microbatches": 4}),
    ("mistral", "dp+pp", "stage=2,data=4", {"microbatches": 4}),
]


# Tiers: sweeps, every case (each window's keeper: the Tiers comment above test_qwen_trains_...).
@pytest.mark.sweep
@pytest.mark.parametrize(
    ("kind", "plan", "mesh", "opts"), WINDOW_CASES, ids=[f"{c[1]}-{c[0]}" for c in WINDOW_CASES]
)
def test_a_sliding_window_trains_under_the_plans_as_on_one_device(kind, plan, mesh, opts):
    """The window masks by global positions under a context split (the ring's blocks, all-to-all's whole
    sequence), and each layer keeps its own; a pipeline runs one window in every layer, so it takes
    Mistral's and refuses Qwen2's layers of different windows in one line."""
    cfg = config_from_hf(WINDOWED[kind])
    assert cfg.layer_windows == ((4, 4) if kind == "mistral" else (None, 4))
    if get_plan(plan).pipeline and kind == "qwen2":
        with pytest.raises(MeshkitError, match="runs in the layers form only") as e:
            _certificate(cfg, plan, mesh, opts)
        assert "\n" not in str(e.value)
        return
    cert = _certificate(cfg, plan, mesh, opts)
    assert cert.ok, str(cert)


MIXTRAL = {
    **SMALL,
    "model_type": "mixtral",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
}
QWEN2_MOE = {**SMALL, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}  # fmt: skip
MOE_PLANS = [("ep", "expert=8"), ("fsdp+ep", "data=2,expert=4"), ("tp+ep", "expert=4,model=2")]


def test_a_shared_expert_is_in_the_models_shape_and_the_planners_count():
    """The Qwen2-MoE's shape carries its shared expert, back and forth, and the planner counts its
    parameters exactly (the shared MLP and its gate beside the routed experts; a shape has no q/k/v
    biases, which the planner leaves out for every Qwen2)."""
    from meshkit.planner.sizes import param_count

    cfg = config_from_hf(QWEN2_MOE)
    shape = cfg.shape()
    assert shape.shared_ffn == 24 and llama.LlamaConfig.from_shape(shape).shared_ffn == 24
    params = jax.eval_shape(llama.init, jax.random.key(0), dataclasses.replace(cfg, qkv_bias=False))
    assert param_count(shape) == sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(params)
    )  # no biases in a shape
    assert param_count(dataclasses.replace(shape, shared_ffn=0)) == param_count(shape) - 2 * (
        3 * 32 * 24 + 32
    )


# Tiers: sweeps, every plan (fsdp+ep was core, 16.8 s): the Mixtral's config.json read dropless with
# renormalised gates and its window is core in test_windows_and_experts_read_and_write_as_their_own_model_type
# [mixtral], its checkpoint's logits and greedy tokens transformers' in test_hf_families.py's [hf-mixtral];
# the dropless step (renormalised gates, k=2) under ep and fsdp in test_moe_dropless.py's
# test_dropless_step_equals_one_device_in_float64 (its ledger and peak under ep beside it), plan fsdp+ep
# (dense leaves ZeRO-3 over data, experts over expert: float64 = one device, ledger = model) in
# test_fsdp_axes.py's test_fsdp_ep_matches_one_device_in_float64_and_its_ledger_the_model[llama].
@pytest.mark.sweep
@pytest.mark.parametrize(
    ("kind", "plan", "mesh"),
    [(k, *p) for k in ("mixtral", "qwen2_moe") for p in MOE_PLANS] + [("qwen2_moe-dense", "ep", "expert=8")],
    ids=[f"{k}-{p[0]}" for k in ("mixtral", "qwen2_moe") for p in MOE_PLANS] + ["qwen2_moe-dense-ep"],
)
def test_an_imported_mixture_trains_under_the_expert_plans_as_on_one_device(kind, plan, mesh):
    """The Mixtral config.json reads dropless with renormalised gates (and its window), the Qwen2-MoE's with
    its shared expert (a dense MLP every token runs, split like the attention), and with a dense layer
    between routed ones: each device runs its experts' rows of the gathered tokens, float64 equal to one
    device, the ledger the model's."""
    dense = {"num_hidden_layers": 3, "mlp_only_layers": [1]} if kind.endswith("-dense") else {}
    cfg = config_from_hf(MIXTRAL if kind == "mixtral" else {**QWEN2_MOE, **dense})
    want = (8, 0.0, True, 8, 0) if kind == "mixtral" else (8, 0.0, False, None, 24)
    assert (cfg.experts, cfg.capacity_factor, cfg.router_renormalize, cfg.window, cfg.shared_ffn) == want
    assert cfg.dense_layers == ((False, True, False) if dense else None)
    # a dense layer among routed ones dispatches nothing; under layer remat the gathers are redone, the
    # outputs' scatters (which only join the residual) not
    cert = _certificate(cfg, plan, mesh, {"remat": "layer"} if dense else {})
    assert cert.ok, str(cert)


GPT_OSS = {**SMALL, "model_type": "gpt_oss", "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 4,
           "sliding_window": 8, "intermediate_size": 16, "swiglu_limit": 0.05, "transformers_version": "5.25.0"}  # fmt: skip
"""GPT-OSS (its YaRN by default, every other layer's window, sinks, biases everywhere) with a clamp that binds at
these sizes (5.x's ``swiglu_limit``)."""
GLM4_MOE = {**SMALL, "model_type": "glm4_moe", "n_routed_experts": 8, "num_experts_per_tok": 2, "head_dim": 4,
            "moe_intermediate_size": 16, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.0, "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True}  # fmt: skip
"""GLM-4.5 (DeepSeek-V3's mixture: sigmoid scores, the choice among 2 of 4 groups, scaled gates, an ungated shared
expert, the first layer dense; half of each head rotated, q/k/v biases, per-head q/k norms)."""
#: (family, plan, mesh, key/value heads); under tp alone float64 only: the ledger has no model of experts split
#: over the model axis without an expert axis (measured for a Mixtral too: 1,266,944 B of all-reduces against
#: 578,816)
NEW_MOE = [(f, *p) for f in ("gpt_oss", "glm4_moe") for p in [
    ("ep", "expert=8", 2), ("fsdp+ep", "data=2,expert=4", 2), ("tp+ep", "expert=4,model=2", 2), ("fsdp", "data=8", 2),
    ("tp", "model=8", 8)]]  # fmt: skip


# Tiers: sweeps, every plan (gpt_oss-tp+ep, 30 s, and glm4_moe-tp+ep, 21 s, were core; moved when make test
# measured 22 min): experts beside tensor parallelism (expert leaves split over expert and model, their ledger
# the model's) are core in test_axis_combos.py's gpt-fsdp+tp+ep, expert parallelism dropless (GPT-OSS's
# renormalised routing) in test_moe_dropless.py's ep cases; GPT-OSS's and GLM-4.5's layers (sinks, biases,
# YaRN and alternating windows; the sigmoid router over groups, the shared experts, the dense first layer,
# per-head q/k norms) against transformers' logits and greedy tokens in
# test_hf_families.py's hf-gpt-oss and hf-glm4-moe (GLM-4.5's config.json read there as its switches),
# GPT-OSS's config.json read as its switches in test_each_family_reads_its_switches_and_..._type[gpt_oss].
@pytest.mark.parametrize(
    ("kind", "plan", "mesh", "kv"),
    tiered(NEW_MOE, [f"{c[0]}-{c[1]}" for c in NEW_MOE], core=set()),
)
def test_gpt_oss_and_glm_train_under_the_plans_as_on_one_device(kind, plan, mesh, kv):
    """GPT-OSS's config.json reads as its switches (sinks, o and router and expert biases, float32 norm scales,
    the clamped SwiGLU, dropless renormalised routing, every other layer's window, YaRN), GLM-4.5's as
    DeepSeek-V3's mixture; under each plan float64 equals one device and the ledger its model."""
    cfg = config_from_hf({**(GPT_OSS if kind == "gpt_oss" else GLM4_MOE), "num_key_value_heads": kv})
    params = llama.init(jax.random.key(0), cfg)
    axes = llama.logical_axes(params)["blocks"][-1]
    if kind == "gpt_oss":
        assert (cfg.sinks, cfg.o_bias, cfg.moe_bias, cfg.wide_norms, cfg.qkv_bias) == (True,) * 5
        assert (cfg.swiglu_limit, cfg.capacity_factor, cfg.router_renormalize) == (0.05, 0.0, True)
        assert (cfg.window, cfg.sliding, type(cfg.rope_scaling).__name__) == (8, (True, False), "YarnRope")
        assert (axes["attn"]["sinks"], axes["attn"]["bo"]) == (("heads",), ("embed",))
        assert (axes["moe"]["b_gate"], axes["moe"]["b_down"]) == (("expert", "mlp"), ("expert", "embed"))
    else:
        assert (cfg.sigmoid_router, cfg.expert_groups, cfg.top_groups, cfg.routed_scale) == (True, 4, 2, 2.0)
        assert (cfg.shared_ffn, cfg.shared_gate, cfg.dense_layers, cfg.rotary_dim) == (
            16,
            False,
            (True, False),
            2,
        )
        assert "w_shared_gate" not in params["blocks"][1]["shared"]
        assert axes["moe"]["router_choice_bias"] == (None,) and (
            axes["attn"]["bq"],
            axes["attn"]["q_norm"],
        ) == (
            ("heads",),
            (None,),
        )
    cert = _certificate(cfg, plan, mesh, {})
    if plan == "tp":
        assert cert.exact_vs_single_device <= 1e-10, str(cert)
        return
    assert cert.ok, str(cert)


def test_glm_checkpoints_multi_token_prediction_layers_are_left_aside(tmp_path):
    """GLM-4.5's checkpoints carry ``num_nextn_predict_layers`` layers past the last (``model.layers.{L}.*``), which
    transformers builds no module for: read and left aside where the config counts them, refused as undeclared
    tensors where it does not."""
    import json

    from safetensors.numpy import save_file

    cfg = config_from_hf({**GLM4_MOE, "n_group": 1, "topk_group": 1})
    interop.save(llama.init(jax.random.key(0), cfg), cfg, tmp_path)
    save_file(
        {"model.layers.2.eh_proj.weight": np.zeros((32, 64), np.float32)}, str(tmp_path / "mtp.safetensors")
    )
    index = tmp_path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
    else:
        data = {"metadata": {}, "weight_map": {}}
        names = Checkpoint(tmp_path).names() - {"model.layers.2.eh_proj.weight"}
        data["weight_map"] = {n: "model.safetensors" for n in names}
    data["weight_map"]["model.layers.2.eh_proj.weight"] = "mtp.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(
        InteropError, match=r"1 tensor\(s\) its config.json does not declare \(model.layers.2.eh_proj"
    ):
        interop.load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert interop.load(tmp_path)[1] == cfg


# Tiers: sweeps: ``--init-from hf:`` of a Llama checkpoint is core in test_llama_cli.py
# (test_init_from_the_export_starts_from_its_weights), a run from another model type's checkpoint exported
# as that type in test_gemma.py's gemma2 run, Qwen3's config and weights written and read as qwen3 in
# test_each_family_reads_its_switches_and_writes_its_own_model_type[qwen3], the Llama family's per-head norms
# against transformers in test_hf_families.py's hf-glm4-moe.
RUN_FROM = {
    "qwen3": {"model_type": "qwen3", "head_dim": 8},
    "gpt_oss": {"model_type": "gpt_oss", "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 16, "sliding_window": 8},
}  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("kind", list(RUN_FROM))
def test_a_run_from_a_checkpoint_trains_and_exports_as_its_model_type(tmp_path, kind):
    """``--init-from hf:DIR`` with a Qwen3 (or a GPT-OSS) checkpoint: the run's model is the checkpoint's (qk_norm
    on, its weights; the sinks, biases and clamp), and ``meshkit export`` writes it back as its model_type."""
    import io
    import json

    from rich.console import Console

    from meshkit.data import load
    from meshkit.train import config as C
    from meshkit.train.job import prepare
    from meshkit.train.loop import train
    from meshkit.train.outputs import export_run

    data = load(C.tiny().data.data)
    model = config_from_hf({**SMALL, **RUN_FROM[kind], "vocab_size": len(data.chars), "num_attention_heads": 4,
                            "max_position_embeddings": 64})  # fmt: skip
    params = llama.init(jax.random.key(1), model)
    interop.save(params, model, tmp_path / "ckpt", vocab=data.chars)
    cfg = C.tiny().replace(model="llama", layers=2, width=32, heads=4, kv_heads=2, plan="dp", steps=2,
                           eval_every=0, init_from=f"hf:{tmp_path / 'ckpt'}", run_dir=str(tmp_path / "run"))  # fmt: skip
    job = prepare(cfg)
    assert job.model == model
    attn = job.trainer.params["blocks"][0]["attn"]
    assert attn["q_norm"].shape == (8,) if kind == "qwen3" else attn["sinks"].shape == (4,)
    assert train(job, Console(file=io.StringIO()))
    (tmp_path / "run" / "config.json").write_text(C.dumps(cfg))
    export_run(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind
    assert interop.read_config(tmp_path / "out") == model


#: The fields of the Hub's config.json of Llama-3.2-1B, Qwen2.5-0.5B and Qwen3-0.6B (their sizes made
#: tiny): the strict field check refuses none of them.
HUB = {
    "llama-3.2": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 8, "hidden_act": "silu",
                  "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                  "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
                  "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
                  "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                  "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                  "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 64},
    "qwen2.5": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
                "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
                "intermediate_size": 64, "max_position_embeddings": 32768, "max_window_layers": 24,
                "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
                "use_cache": True, "use_sliding_window": False, "vocab_size": 64},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
              "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 40960,
              "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 64},
    # microsoft/Phi-3-mini-4k-instruct's (its fields as a public repository's model table copies them)
    "phi-3-mini": {"_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
                   "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                   "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}, "bos_token_id": 1, "embd_pdrop": 0.0,
                   "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
                   "intermediate_size": 64, "max_position_embeddings": 4096, "model_type": "phi3",
                   "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                   "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
                   "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
                   "use_cache": True, "attention_bias": False, "vocab_size": 64},
}  # fmt: skip


#: openai/gpt-oss-120b's config.json (https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json, as a
#: public repository's test copies it, read 2026-10-02), its sizes made tiny and its MXFP4 quantization aside
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 16, "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 8, "output_router_logits": False,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 64,
}  # fmt: skip
MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"], "quant_method": "mxfp4"}  # fmt: skip


def test_gpt_oss_reads_openais_config_and_its_rotary_as_the_writer_computes():
    """OpenAI's own config reads (its aliases checked, its windows every other layer); its MXFP4 experts, an alias
    that disagrees, and a clamp or a null rotary whose meaning depends on the transformers that wrote it are
    refused in one line naming the field; the rotary a config does not name is GPT-OSS's YaRN in both versions."""
    cfg = config_from_hf(GPT_OSS_120B)
    assert (cfg.window, cfg.sliding, cfg.experts, cfg.experts_per_token) == (128, (True, False) * 2, 8, 4)
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.truncate, cfg.rope_theta) == (32.0, False, 150000.0)
    assert config_from_hf(config_to_hf(cfg)) == cfg and config_to_hf(cfg)["model_type"] == "gpt_oss"
    refused = {
        "quantization_config": ({"quantization_config": MXFP4}, "quant_method 'mxfp4'.*dequantized"),
        "alias": ({"experts_per_token": 2}, "experts_per_token=2 and num_experts_per_tok=4 differ"),
        "clamp": (
            {"swiglu_limit": 5.0},
            "swiglu_limit=5.0, swiglu_alpha=1.702 in a config transformers 4.55",
        ),
        "null rotary": (
            {"rope_scaling": None, "transformers_version": None},
            "rope_scaling null .* no transformers",
        ),
        "no bias": ({"attention_bias": False}, "attention_bias"),
    }
    for change, says in refused.values():
        with pytest.raises(InteropError, match=says):
            config_from_hf(
                {
                    k: v
                    for k, v in {**GPT_OSS_120B, **change}.items()
                    if v is not None or k != "transformers_version"
                }
            )
    unnamed = {k: v for k, v in GPT_OSS_120B.items() if k not in ("rope_scaling", "rope_theta")}
    assert config_from_hf(unnamed).rope_scaling == cfg.rope_scaling  # both versions' default
    null = {**GPT_OSS_120B, "rope_scaling": None}
    assert config_from_hf(null).rope_scaling is None  # 4.x wrote it: the plain rotary
    assert config_from_hf({**null, "transformers_version": "5.25.0"}).rope_scaling == cfg.rope_scaling
    assert (
        config_from_hf({**GPT_OSS_120B, "swiglu_limit": 5.0, "transformers_version": "5.0.0"}).swiglu_limit
        == 5.0
    )


def test_gpt_oss_sinks_are_refused_under_a_context_split_in_one_line():
    from meshkit.spec import PlanError
    from meshkit.train import Trainer

    cfg = config_from_hf({**GPT_OSS, "max_position_embeddings": 32})
    tokens = np.zeros((8, 33), np.int32)
    t = Trainer(llama.make_loss(cfg), llama.init(jax.random.key(0), cfg), optax.sgd(0.1), plan="cp", mesh="context=8",
                logical_axes=llama.logical_axes)  # fmt: skip
    with pytest.raises(PlanError, match=r"attention sinks \(GPT-OSS's\) under a context split of 8"):
        t.step((tokens[:, :-1], tokens[:, 1:]))


@pytest.mark.parametrize("name", list(HUB))
def test_the_hubs_own_configs_are_read(name):
    cfg = config_from_hf(HUB[name])
    assert cfg.tie_embeddings == (name != "phi-3-mini") and (cfg.rope_scaling is not None) == (
        name == "llama-3.2"
    )
    assert (cfg.fused, cfg.window) == ((True, 2047) if name == "phi-3-mini" else (False, None))


def test_a_mixture_checkpoints_experts_are_the_runs_shape(tmp_path):
    """``--init-from`` a Mixtral: the run's shape (what the planner and the memory check see) takes the
    checkpoint's experts, top-k and dropless routing, whatever ``--experts`` says."""
    from meshkit.data import load
    from meshkit.train import config as C
    from meshkit.train.job import model_shape

    data = load(C.tiny().data.data)
    model = config_from_hf({**SMALL, "model_type": "mixtral", "vocab_size": len(data.chars), "num_local_experts": 4,
                            "num_experts_per_tok": 2, "max_position_embeddings": 64})  # fmt: skip
    interop.save(llama.init(jax.random.key(1), model), model, tmp_path / "ckpt", vocab=data.chars)
    cfg = C.tiny().replace(model="llama", layers=2, width=32, heads=4, kv_heads=2, experts=0,
                           init_from=f"hf:{tmp_path / 'ckpt'}")  # fmt: skip
    shape = model_shape(cfg, registry.family("llama"), len(data.chars))
    assert (shape.experts, shape.experts_per_token, shape.capacity_factor) == (4, 2, 0.0)
