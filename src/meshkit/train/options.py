"""The options of ``meshkit train``, section by section: each declared once with ``meshkit.spec.option`` (its
default, what ``--help`` says of it, what a run fixes by it), so that everything that lists options follows
from these declarations (``meshkit.train.config``: the flags, a config file's tables, what ``--resume`` may
change). The fifth section, the layout, is ``meshkit.spec.ParallelSpec``."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.models import registry
from meshkit.spec import GRPO_LOSSES, PREFERENCE_LOSSES, QUANTIZE, TASKS, one_of, option, plans_of

SHAPE = "the model's shape"
ROUTING = "the model's routing"
TRAINED = "the trained parameters"
SCHEDULE = "the learning-rate schedule"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelOptions:
    """The model trained: its family, its shape, where its weights start, and LoRA's adapters."""

    model: str = option("gpt", help=f"{registry.summary()}.", fixes="the model", later=True)
    """The decoder trained: a family of ``meshkit.models.registry`` (the GPT, the Llama, the Gemma)."""
    layers: int = option(2, help="Transformer blocks.", fixes=SHAPE, least=1)
    width: int = option(128, help="Model width.", fixes=SHAPE, least=1)
    """Model width (embedding dimension)."""
    heads: int = option(4, help="Attention heads (must divide --width).", fixes=SHAPE, least=1)
    kv_heads: int = option(
        0,
        help="Llama: key/value heads (must divide --heads).",
        shown="as many as --heads",
        fixes=SHAPE,
        later=True,
        least=0,
        note=" (0: as many as --heads)",
    )
    """Grouped-query attention's key/value heads (must divide heads); 0: as many as heads."""
    tie_embeddings: bool = option(
        False, help="Llama: the output head is the token embedding.", shown="off", fixes=SHAPE, later=True
    )
    scan_layers: bool = option(False, help="Stack the blocks under lax.scan.")
    """The scanned form: blocks stacked under lax.scan (compile time flat in depth); a resumed run may change it."""
    loss_chunk: int = option(
        0,
        help="Compute the head and the loss this many positions at a time, never the whole logits "
        "(a divisor of --seq-len).",
        shown="0: all at once",
        least=0,
        note=" (0: all at once)",
    )
    """``token_loss.head_loss``'s pieces: ``B x loss_chunk x V`` logits at a time; a resumed run may change it."""
    quantize: str = option("none", help=f"The blocks' matmuls: {one_of(QUANTIZE)}.", shown="none")
    """``meshkit.models.quantize``: quantized training of the blocks' matmuls; a resumed run may change it."""
    init_from: str | None = option(
        None,
        help="Start from a Hugging Face checkpoint: hf:DIR (config.json + safetensors).",
        shown="random",
        fixes="the initialisation",
        later=True,
    )
    """'hf:DIR' (config.json + safetensors) instead of random weights; its shape must be the run's."""
    experts: int = option(
        0,
        help=f"Mixture of experts: MLPs per layer (plans {one_of(plans_of('expert'), 'and')} split them).",
        shown="0: a dense MLP",
        fixes=SHAPE,
        later=True,
    )
    """MLPs per layer (0: a dense MLP; ``ModelShape.experts``)."""
    experts_per_token: int = option(
        2, help="Mixture of experts: experts per token (top-k).", fixes=ROUTING, later=True
    )
    capacity_factor: float = option(
        1.25,
        help="Mixture of experts: slots per expert = ceil(factor x T x k / experts); "
        "0: dropless (every slot runs).",
        fixes=ROUTING,
        later=True,
    )
    """An expert takes at most ceil(capacity_factor x T x k / experts) slots of a sequence."""
    lora_rank: int = option(
        0,
        help="LoRA: the adapters' rank; the base weights stay frozen.",
        shown="0: full fine-tuning",
        fixes=TRAINED,
        later=True,
        least=0,
        note=" (0: full fine-tuning)",
    )
    """LoRA (``meshkit.models.lora``): the adapters' rank; 0: full fine-tuning."""
    lora_alpha: float | None = option(
        None,
        help="LoRA: the update is scaled by alpha / rank.",
        shown="LoRA's: 16",
        fixes=TRAINED,
        later=True,
    )
    """None: ``lora.LoraConfig``'s alpha. Given without a rank, it is refused, never ignored."""
    lora_targets: str | None = option(
        None, help="LoRA: comma-separated matrices to adapt.", shown="wq,wk,wv,wo", fixes=TRAINED, later=True
    )
    """Comma-separated keys of the matrices adapted; None: ``lora.DEFAULT_TARGETS``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerOptions:
    """The optimizer and its learning-rate schedule (``meshkit.train.optim``)."""

    optimizer: str = option("adamw", help="adamw or sgd (momentum).", fixes="the optimizer")
    lr: float = option(3e-3, help="Peak learning rate (warmup + cosine).", fixes=SCHEDULE, above=0)
    warmup: int | None = option(
        None,
        help="Linear warmup steps (below --steps).",
        shown="a tenth of --steps, rounded down",
        fixes=SCHEDULE,
    )
    """None: a tenth of ``steps`` (rounded down), so any step count works."""
    weight_decay: float = option(0.01, fixes="the optimizer", least=0)
    """AdamW's weight decay (a config file or ``--set`` gives it)."""
    momentum: float = option(0.9, fixes="the optimizer")
    """SGD's momentum."""
    clip: float | None = option(
        1.0,
        help="Global-norm clipping (0 turns it off).",
        fixes="the optimizer",
        above=0,
        note=" (0 turns it off)",
    )
    """Global-norm gradient clipping (None: off)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataOptions:
    """What is trained on, in what order, and how a batch is formed (``meshkit.train.task``)."""

    data: str | None = option(
        None,
        fixes="the data",
        shown="Python's reference docs (pydoc_data), per character",
        help="A directory made by 'meshkit data prepare' (BPE token shards), a UTF-8 text file (per character) or a .npy "
        "of token ids; DIR:WEIGHT,DIR:WEIGHT mixes prepared directories of one tokenizer by the weights "
        "(normalised), e.g. web:0.7,code:0.3.",
    )
    """A prepared directory, a text file, a .npy of ids, or a mixture of prepared directories
    (:mod:`meshkit.data.mixture`); None: Python's own reference docs (pydoc_data.topics), per character."""
    seq_len: int = option(
        128,
        help="Tokens (characters, for text) per sequence.",
        fixes="the model's shape and the data order",
        least=1,
    )
    batch_size: int = option(32, help="Global batch in sequences.", fixes="the data order", least=1)
    seed: int = option(
        0, help="Seed of initialisation and data order.", fixes="the initialisation and the data order"
    )
    task: str = option(
        "pretrain",
        help=f"What is trained: {one_of(TASKS)}.",
        fixes="the loss and the data stream",
        later=True,
    )
    """'pretrain' (every token), 'sft' (conversations: the loss on the assistant's tokens only) or 'dpo'
    (preference pairs: ``meshkit.models.preference``)."""
    document_masks: bool = option(
        False,
        help="Pretraining: packed documents attend within themselves, positions from 0 in each.",
        shown="off",
        fixes="the attention and the data stream",
        later=True,
    )


POST = "the loss"


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveOptions:
    """What post-training optimises: ``--task dpo``'s preference loss (``meshkit.models.preference``) and
    ``--task grpo``'s rewards, rollouts and clipped loss (``meshkit.models.grpo``, ``meshkit.train.rollout``);
    each refused when given to a task that does not read it (``meshkit.train.task``)."""

    beta: float | None = option(
        None,
        help="--task dpo and grpo: how far the policy may move from the reference (grpo: the KL's weight).",
        shown="dpo 0.1, grpo 0.0",
        fixes=POST,
        later=True,
        least=0,
    )
    """DPO's inverse temperature (SimPO's reward scale); GRPO's KL weight (0: no reference is run)."""
    preference_loss: str = option(
        "sigmoid", help=f"--task dpo: the objective, {one_of(PREFERENCE_LOSSES)}.", fixes=POST, later=True
    )
    label_smoothing: float = option(
        0.0, help="--task dpo: the share of pairs taken as mislabelled.", fixes=POST, later=True, least=0
    )
    simpo_gamma: float = option(
        0.5, help="--preference-loss simpo: the target reward margin.", fixes=POST, later=True, least=0
    )
    reward: str | None = option(
        None,
        help="--task grpo: the reward, comma-separated rewards summed: exact (the row's answer), "
        "regex:PATTERN, or a function MODULE:NAME / FILE.py:NAME(prompts, completions, **columns).",
        shown="none",
        fixes=POST,
        later=True,
    )
    generations: int = option(
        8, help="--task grpo: completions sampled per prompt (a group).", fixes=POST, later=True, least=2
    )
    max_new_tokens: int = option(
        32, help="--task grpo: a completion's most tokens.", fixes=POST, later=True, least=1
    )
    temperature: float = option(
        1.0, help="--task grpo: the sampling temperature.", fixes=POST, later=True, above=0
    )
    grpo_loss: str = option(
        "dapo",
        help=f"--task grpo: how token losses are averaged, {one_of(GRPO_LOSSES)}.",
        fixes=POST,
        later=True,
    )
    epsilon: float = option(
        0.2, help="--task grpo: the ratio's clip below, 1 - epsilon.", fixes=POST, later=True, above=0
    )
    epsilon_high: float | None = option(
        None,
        help="--task grpo: the ratio's clip above, 1 + epsilon-high (DAPO's clip-higher).",
        shown="--epsilon",
        fixes=POST,
        later=True,
        above=0,
    )
    scale_rewards: bool = option(
        True,
        help="--task grpo: divide advantages by their group's standard deviation (off: Dr. GRPO).",
        shown="on",
        fixes=POST,
        later=True,
    )
    updates_per_rollout: int = option(
        1, help="--task grpo: optimizer steps on each rollout batch.", fixes=POST, later=True, least=1
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How long the run trains, and what it measures and writes around the training."""

    steps: int = option(400, help="Optimizer steps in total.", fixes=SCHEDULE)
    """A resumed run continues up to this count (the schedule spans it: ``--stop-after`` stops early)."""
    run_dir: str = option(
        "runs/latest", help="Output directory.", shown="a new runs/<time>; with --resume, runs/latest"
    )
    """Where config.json, metrics.jsonl, report.json, plots and checkpoints go (the CLI gives each new run
    its own runs/<time> and points runs/latest at it)."""
    eval_every: int = option(
        50, help="Evaluate every k steps (0: at the end only).", least=0, note=" (0: at the end only)"
    )
    eval_batches: int = option(4, least=1)
    """Held-out batches per evaluation."""
    eval_tasks: str | None = option(
        None,
        shown="none",
        help="Multiple-choice tasks scored at each evaluation (acc, acc_norm per task, as "
        'lm-evaluation-harness): JSONL files of {"query", "choices", "gold"} rows, comma-separated, or a shipped '
        "task: python_docs.",
    )
    checkpoint_every: int = option(100, help="Checkpoint every k steps.", least=1)
    """Save a checkpoint every this many steps (and always at the end)."""
    sample_chars: int = option(200, help="Characters to sample at the end.", least=0)
    tensorboard: bool = option(
        False, help="Also write TensorBoard event files beside metrics.jsonl.", shown="off"
    )
    plan_reason: str | None = option(None)
    """Why ``--plan auto`` chose the plan (None: the plan was given)."""
    export_hf: bool = option(
        False,
        shown="off",
        help="At the end, write the model as a Hugging Face checkpoint into the run's hf/.",
    )
    tracker: str = option(
        "jsonl",
        help="Where the metrics go, comma-separated: jsonl (always), tensorboard, wandb (offline unless "
        "WANDB_MODE says otherwise; pip install 'meshkit[wandb]').",
    )
    peak_tflops: float | None = option(
        None,
        help="One device's peak TFLOP/s, for MFU in the summary, report.json and metrics.jsonl (default: the "
        "table's figure for the GPU or TPU at the run's precision; none on a CPU).",
        above=0,
        note=" (one device's peak)",
    )
