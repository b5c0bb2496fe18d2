"""Which ``transformers`` causal LMs :class:`~lightning_async_pp.models.CausalLM` can cut, found by structure.

A decoder-only causal LM is accepted when its base model holds the pieces the pipeline layers are made of: the
token embedding (``get_input_embeddings()``), one ``ModuleList`` of decoder layers, one final norm, optionally a
rotary embedding, learned position embeddings and an embedding dropout, and the head is
``get_output_embeddings()``. A constant step that a family's forward takes between those pieces (Granite's
embedding multiplier, Gemma 2's logit soft-capping, ...) is declared in :data:`TRANSFORMS`, by the configuration
attribute that holds its constant.

Finding the pieces proves nothing about what the forward does between them, so each cut is proved before
training: :func:`prove_cut` builds a small copy of the same configuration on the CPU (:func:`narrow_config`), runs
its pipeline layers in order, and compares their logits with ``transformers``' own forward, with and without
padding. For a mixture of experts it also compares, in training mode, the pipeline's objective (the language-model
loss and the routers' terms, :mod:`~lightning_async_pp.models.hf_moe`) and the gradient of every parameter with
``transformers``' own ``.loss`` and its gradients. A family whose forward or objective does anything else is
refused with what differed.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from lightning_async_pp.runtime.contract import run_layers

PROOF_DTYPE = torch.float32
PROOF_TOLERANCE = 1e-5
"""Largest difference the proof accepts between the pipeline's logits and ``transformers``' own, relative to the
largest logit (float32, logits of order one to ten: above float32 rounding, far below any step the pipeline would
miss). (float64 is no stricter here: ``transformers``' eager attention turns left-padded rows into NaN in it.)"""

PROOF_WIDTH = dict(heads=4, intermediate=128, vocab=256, sliding_window=4, batch=2, tokens=10)
"""The proof's small copy: attention heads (each of the configuration's own head size), MLP width, vocabulary,
sliding window (below the proof's sequence length, so sliding layers differ from full ones), batch size and
tokens of its random batch."""


class Objective(Protocol):
    """A training objective on the pipeline layers' output (:class:`~lightning_async_pp.models.hf_moe.Objective`)."""

    def __call__(self, output: Any, labels: Tensor) -> Tensor:
        """The loss that is back-propagated (its value may leave out terms whose gradient it carries)."""
        ...

    def value(self, output: Any, labels: Tensor) -> Tensor:
        """The whole objective's value."""
        ...


Cut = Callable[[nn.Module], tuple[list[nn.Module], "Objective | None"]]
"""A model's pipeline layers, and the objective to prove on them (``None``: the logits alone are proved)."""


@dataclass(frozen=True)
class Transform:
    """A constant step a family's forward takes between the pipeline's pieces, read from its configuration.

    Args:
        attribute: The configuration attribute holding the constant; the step applies when it is set (not
            ``None``).
        where: ``"embedding"`` (right after the token embedding) or ``"logits"`` (after the head).
        operation: ``"multiply"``, ``"divide"``, or ``"softcap"`` (``c * tanh(x / c)``).
    """

    attribute: str
    where: Literal["embedding", "logits"]
    operation: Literal["multiply", "divide", "softcap"]

    def __call__(self, x: Tensor, value: float) -> Tensor:
        if self.operation == "multiply":
            return x * value
        if self.operation == "divide":
            return x / value
        return torch.tanh(x / value) * value


TRANSFORMS = (
    Transform("embedding_multiplier", "embedding", "multiply"),  # Granite
    Transform("logit_scale", "logits", "multiply"),  # Cohere, Cohere 2
    Transform("logits_scaling", "logits", "divide"),  # Granite
    Transform("final_logit_softcapping", "logits", "softcap"),  # Gemma 2, Gemma 3
)
"""The steps :func:`find_structure` applies where a configuration sets their attribute; the proof confirms
them. (Gemma's embedding scale, sqrt(hidden_size), lives inside its embedding module and needs no entry.)"""


class Steps(nn.Module):
    """The declared steps of one place (embedding or logits), applied in order; no parameters."""

    def __init__(self, steps: Sequence[tuple[Transform, float]]) -> None:
        super().__init__()
        self.steps = list(steps)

    def forward(self, x: Tensor) -> Tensor:
        for transform, value in self.steps:
            x = transform(x, value)
        return x

    def extra_repr(self) -> str:
        return ", ".join(f"{t.operation} by {t.attribute}={v}" for t, v in self.steps)


@dataclass
class Structure:
    """The pieces of a decoder-only causal LM, as :func:`find_structure` found them."""

    embed_tokens: nn.Module
    positions: nn.Module | None
    dropout: nn.Module | None
    embedding_steps: Steps | None
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    logit_steps: Steps | None
    rotary: nn.Module | None
    rotary_by_type: bool


def refuse_unsupported(config: Any) -> None:
    """Refuse, from the configuration alone, the models whose structure the pipeline cannot carry."""
    model_type = getattr(config, "model_type", None)
    if any(hasattr(config, key) for key in ("vision_config", "audio_config")) or (
        getattr(config, "text_config", None) is not None and config.text_config is not config
    ):
        raise ValueError(
            f"CausalLM does not support multimodal models (model_type={model_type!r}); train the text decoder "
            "as its own causal LM instead."
        )
    if getattr(config, "add_cross_attention", False):
        raise ValueError("CausalLM does not support cross-attention (config.add_cross_attention=True).")


def attention_types(config: Any) -> list[str]:
    """Each decoder layer's attention: ``"full_attention"`` or ``"sliding_attention"``."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)[:n]
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _steps(config: Any, where: str) -> Steps | None:
    found = [(t, getattr(config, t.attribute, None)) for t in TRANSFORMS if t.where == where]
    found = [(t, float(v)) for t, v in found if v is not None]
    return Steps(found) if found else None


def find_structure(model: nn.Module) -> Structure:
    """The pieces of a ``transformers`` causal LM, or a ``ValueError`` saying which are missing or extra."""
    config = model.config
    base = model.base_model
    embed_tokens, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    children = dict(base.named_children())
    layers = [name for name, child in children.items() if isinstance(child, nn.ModuleList)]
    rotary = [name for name, child in children.items() if "Rotary" in type(child).__name__]
    dropout = [name for name, child in children.items() if isinstance(child, nn.Dropout)]
    positions = [
        name for name, child in children.items() if isinstance(child, nn.Embedding) and child is not embed_tokens
    ]
    named = {name for name, child in children.items() if child is embed_tokens}
    rest = [name for name in children if name not in {*named, *layers, *rotary, *dropout, *positions}]
    problems = []
    if not named:
        problems.append("the token embedding (get_input_embeddings()) is not a child of the base model")
    if not isinstance(lm_head, nn.Linear):
        problems.append(f"the head (get_output_embeddings()) is {type(lm_head).__name__}, not a Linear")
    if len(layers) != 1 or len(children[layers[0]]) < config.num_hidden_layers:
        problems.append(f"{len(layers)} ModuleLists of decoder layers instead of one")
    for kind, names in (("final norms", rest), ("rotary embeddings", rotary), ("dropouts", dropout)):
        if len(names) > 1 or (kind == "final norms" and not names):
            problems.append(f"{len(names)} {kind} ({', '.join(names) or 'none'}) instead of one")
    if len(positions) > 1:
        problems.append(f"{len(positions)} position embeddings ({', '.join(positions)}) instead of one at most")
    if problems:
        raise ValueError(
            f"CausalLM cannot find the decoder-only structure of model_type={config.model_type!r} "
            f"({type(model).__name__}): {'; '.join(problems)}. The base model ({type(base).__name__}, children: "
            f"{', '.join(children)}) must hold the token embedding, one ModuleList of decoder layers, one final "
            "norm, and at most one rotary embedding, learned position embedding and embedding dropout. Implement "
            "the pipeline contract for this model yourself (docs/user-guide.md, sections 1-2)."
        )
    return Structure(
        embed_tokens=embed_tokens,
        positions=children[positions[0]] if positions else None,
        dropout=children[dropout[0]] if dropout else None,
        embedding_steps=_steps(config, "embedding"),
        layers=children[layers[0]],
        norm=children[rest[0]],
        lm_head=lm_head,
        logit_steps=_steps(config, "logits"),
        rotary=children[rotary[0]] if rotary else None,
        rotary_by_type=bool(rotary) and "layer_type" in inspect.signature(children[rotary[0]].forward).parameters,
    )


# --- the proof ---------------------------------------------------------------------------------------------


def _per_layer_attributes(config: Any) -> dict[str, list]:
    n = config.num_hidden_layers
    return {
        key: value
        for key, value in config.to_dict().items()
        if isinstance(value, list) and len(value) == n and n > 1 and key != "architectures"
    }


def narrow_config(config: Any) -> Any:
    """A small copy of ``config`` for the proof: the same family and settings, few heads, layers and tokens.

    Each head keeps the configuration's own size (so rotary settings stay valid); the copy has one layer per
    distinct kind of layer (``layer_types`` and other per-layer lists; at least two layers), a narrow MLP, a
    small vocabulary (special token ids outside it become ``None``), a sliding window below the proof's
    sequence length and, for a mixture of experts, few experts and a sparse layer among its first two.
    """
    narrow = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    new_heads = PROOF_WIDTH["heads"]
    updates: dict[str, Any] = {"num_attention_heads": new_heads, "hidden_size": new_heads * head_dim}
    if config.to_dict().get("head_dim") is not None:  # a field (Falcon's is a property)
        updates["head_dim"] = head_dim
    if kv_heads is not None:
        updates["num_key_value_heads"] = 1 if kv_heads == 1 else new_heads // 2 if kv_heads < heads else new_heads
    for key, value in config.to_dict().items():
        if (key.endswith("intermediate_size") and isinstance(value, int)) or key == "n_inner":  # None: 4x wide
            updates[key] = PROOF_WIDTH["intermediate"]
    if getattr(config, "vocab_size", 0) > PROOF_WIDTH["vocab"]:
        updates["vocab_size"] = PROOF_WIDTH["vocab"]
        for key, value in config.to_dict().items():
            if key.endswith("_token_id") and value is not None:
                ids = [value] if isinstance(value, int) else list(value)
                kept = [i for i in ids if i < PROOF_WIDTH["vocab"]]
                updates[key] = (kept[0] if kept else None) if isinstance(value, int) else (kept or None)
    updates.update(_narrow_experts(config))
    if getattr(config, "sliding_window", None) is not None:
        updates["sliding_window"] = min(config.sliding_window, PROOF_WIDTH["sliding_window"])
    per_layer = _per_layer_attributes(config)
    kinds: dict[tuple, int] = {}
    for index in range(config.num_hidden_layers):
        kinds.setdefault(tuple(str(values[index]) for values in per_layer.values()), index)
    chosen = sorted(kinds.values())
    if len(chosen) < 2:
        chosen = [0, 1] if config.num_hidden_layers > 1 else [0]
    updates["num_hidden_layers"] = len(chosen)
    for key, values in per_layer.items():
        updates[key] = [values[i] for i in chosen]
    for key, value in updates.items():
        setattr(narrow, key, value)
    return narrow


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_FIRST_SPARSE = ("first_k_dense_replace", "moe_layer_start_index")  # dense layers before the first sparse one


def _narrow_experts(config: Any) -> dict[str, Any]:
    """A mixture of experts' settings in the small copy: few experts (enough for its top-k and its groups), and a
    sparse layer among the copy's first two."""
    settings = config.to_dict()
    updates: dict[str, Any] = {}
    top_k = getattr(config, "num_experts_per_tok", None)
    top_k = max(top_k) if isinstance(top_k, (list, tuple)) else top_k
    groups, chosen = settings.get("n_group") or 1, settings.get("topk_group") or 1
    for key in _EXPERT_COUNTS:
        experts = settings.get(key)
        if isinstance(experts, int) and not isinstance(experts, bool) and isinstance(top_k, int):
            per_group = max(2, -(-top_k // chosen))  # the group scores take each group's two best experts
            updates[key] = min(experts, max(groups * per_group, 2 * top_k, 4))
    for key in _FIRST_SPARSE:
        if isinstance(settings.get(key), int):
            updates[key] = min(settings[key], 1)
    if isinstance(settings.get("decoder_sparse_step"), int):
        updates["decoder_sparse_step"] = min(settings["decoder_sparse_step"], 2)
    if isinstance(settings.get("mlp_only_layers"), list):
        updates["mlp_only_layers"] = [index for index in settings["mlp_only_layers"] if index < 1]
    return updates


def _proof_batches(vocab_size: int) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = (PROOF_WIDTH["batch"], PROOF_WIDTH["tokens"])
    ids = torch.randint(0, vocab_size, shape, generator=generator)
    mask = torch.ones(shape, dtype=torch.long)
    mask[0, :3] = 0  # left padding on the first row
    return [{"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}]


@torch.no_grad()
def _randomize(model: nn.Module) -> None:
    # Weights of unit scale (not the configuration's small initialisation) so that logits are of order one and
    # any scale, soft-cap or extra step shows far above rounding; norm weights and biases vary around their start.
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        if param.dim() >= 2:
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.copy_(noise / param.shape[-1] ** 0.5)
        else:
            param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _compare(ours: Tensor, theirs: Tensor, mask: Tensor | None) -> tuple[float, tuple[int, int]]:
    difference = (ours - theirs).abs().amax(dim=-1)
    difference = torch.nan_to_num(difference, nan=float("inf"))
    if mask is not None:
        difference = difference.masked_fill(mask == 0, 0.0)  # padded positions carry no loss
    worst = int(difference.argmax())
    return float(difference.max()), divmod(worst, difference.shape[1])


_PROVEN: dict[tuple, str | None] = {}


def prove_cut(config: Any, cut: Cut) -> float:
    """Check that ``cut``'s pipeline layers, run in order, compute ``transformers``' own logits, and their
    objective (where ``cut`` gives one) its own ``.loss`` and gradients.

    On a small copy of ``config`` (:func:`narrow_config`) in float32 on the CPU with unit-scale random weights,
    on a random batch without and with left padding: the largest difference of a logit at a non-padded position
    must stay below :data:`PROOF_TOLERANCE` of the largest logit. With an objective, in training mode from the same
    random state on both sides, the objective's value must match ``.loss`` and each parameter's gradient the
    gradient of ``.loss`` within :data:`PROOF_TOLERANCE` of the largest of them. The verdict is kept per
    configuration class and copy, so that a process proves each configuration once.

    Returns:
        The seconds the proof took (0 when it was already proved in this process).

    Raises:
        ValueError: Saying which logits differed and by how much, or what failed, and what to do instead.
    """
    start = time.perf_counter()
    try:
        narrow = narrow_config(config)
        key = (
            type(config).__qualname__,
            narrow.to_json_string(use_diff=False),
            config._attn_implementation,
            TRANSFORMS,
        )
    except Exception as error:  # the copy's settings are the configuration's own: any failure is its failure
        verdict: str | None = f"could not make a small copy of the configuration ({type(error).__name__}: {error})"
    else:
        if key in _PROVEN:
            verdict = _PROVEN[key]
            if verdict is None:
                return 0.0
        else:
            verdict = _run_proof(narrow, cut)
            _PROVEN[key] = verdict
    if verdict is None:
        return time.perf_counter() - start
    raise ValueError(
        f"CausalLM cannot prove its cut of model_type={config.model_type!r} into pipeline layers: {verdict}. "
        "Implement the pipeline contract for this model yourself (docs/user-guide.md, sections 1-2), or train a "
        "model type the docs list as accepted (section 11)."
    )


def _run_proof(narrow: Any, cut: Cut) -> str | None:
    """``None`` when the cut computes the model's own logits, else what differed."""
    from transformers import AutoModelForCausalLM

    copy_name = f"a {narrow.num_hidden_layers}-layer, {narrow.hidden_size}-wide copy"
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(
                narrow, attn_implementation=narrow._attn_implementation, trust_remote_code=False
            )
        model = model.to(PROOF_DTYPE).eval()
        _randomize(model)
        layers, objective = cut(model)
        batches = _proof_batches(narrow.vocab_size)
        for batch in batches:
            mask = batch.get("attention_mask")
            with torch.no_grad():
                theirs = model(**batch).logits
                ours = run_layers(layers, batch["input_ids"], batch)
            ours = ours if isinstance(ours, Tensor) else ours[0]
            if ours.shape != theirs.shape:
                shapes = f"{tuple(ours.shape)}, not {tuple(theirs.shape)}"
                return f"on {copy_name}, the pipeline's logits have shape {shapes}"
            difference, (row, position) = _compare(ours, theirs, mask)
            largest = float(theirs.abs().max())
            if not difference <= PROOF_TOLERANCE * max(1.0, largest):
                padding = "with" if mask is not None else "without"
                return (
                    f"on {copy_name} in float32, {padding} padding, the pipeline's logits differ from transformers' "
                    f"own by up to {difference:.3g} (batch row {row}, position {position}; largest logit "
                    f"{largest:.3g}; tolerance {PROOF_TOLERANCE:g} of it): its forward does something between the "
                    "token embedding, the decoder layers, the final norm and the head that the pipeline layers do not"
                )
        if objective is not None:
            return _prove_objective(model.train(), layers, objective, batches, copy_name)
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
        return f"running {copy_name} and its pipeline layers failed ({failure})"
    return None


def _prove_objective(
    model: nn.Module, layers: list[nn.Module], objective: Objective, batches: list[dict[str, Tensor]], copy_name: str
) -> str | None:
    """``None`` when ``objective`` on the pipeline layers gives ``transformers``' own ``.loss`` and gradients."""
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    for batch in batches:
        labels = batch["input_ids"]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # the same draws on both sides (a router's jitter, dropout)
            theirs = model(**batch, labels=labels).loss
        expected = torch.autograd.grad(theirs, list(params.values()), allow_unused=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            output = run_layers(layers, batch["input_ids"], batch)
        value = objective.value(output, labels)
        found = torch.autograd.grad(objective(output, labels), list(params.values()), allow_unused=True)
        padding = "with" if "attention_mask" in batch else "without"
        where = f"on {copy_name} in float32 and training mode, {padding} padding"
        if not abs(float(value) - float(theirs)) <= PROOF_TOLERANCE * max(1.0, abs(float(theirs))):
            return (
                f"{where}, the pipeline's objective is {float(value):.6g} and transformers' .loss {float(theirs):.6g}"
                ": its loss has a term (a router's) that the pipeline does not compute, or the other way round"
            )
        largest = max((float(g.abs().max()) for g in expected if g is not None), default=0.0)
        for name, ours, their in zip(params, found, expected):
            ours = torch.zeros_like(params[name]) if ours is None else ours
            their = torch.zeros_like(params[name]) if their is None else their
            difference = float((ours - their).abs().max())
            if not difference <= PROOF_TOLERANCE * max(1.0, largest):
                return (
                    f"{where}, the gradient of {name} differs from the one of transformers' .loss by up to "
                    f"{difference:.3g} (largest gradient {largest:.3g}; tolerance {PROOF_TOLERANCE:g} of it)"
                )
    return None


__all__ = [
    "Cut",
    "Objective",
    "PROOF_TOLERANCE",
    "PROOF_WIDTH",
    "TRANSFORMS",
    "Structure",
    "Transform",
    "attention_types",
    "find_structure",
    "narrow_config",
    "prove_cut",
    "refuse_unsupported",
]
