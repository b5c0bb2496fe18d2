"""A Hugging Face ``transformers`` causal LM as a pipeline-ready ``LightningModule``.

The model is cut into the layers the pipeline contract asks for (:mod:`~lightning_async_pp.models.hf_layers`)::

    [Embedding, DecoderLayer 0, ..., DecoderLayer N-1, Head]

The model is built on the meta device. A stage materialises only its own layers: from the configuration's
initialisation (every layer from its own seed, so one stage and the whole model agree) or, with
``pretrained``, by reading only that layer's tensors from the folder's safetensors files.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn

from lightning_async_pp.checkpoint import TRANSFORMERS_KEY
from lightning_async_pp.checkpoint.index_check import plain_file_name
from lightning_async_pp.meta import MetaLayers
from lightning_async_pp.models.compiling import CompileOption, compile_blocks
from lightning_async_pp.models.data import refuse_custom_code
from lightning_async_pp.models.hf_keys import StoredTensors
from lightning_async_pp.models.hf_layers import (
    DecoderLayer,
    Embedding,
    Head,
    batch_value,
    input_ids,
    split_layers,
)
from lightning_async_pp.models.hf_moe import Objective, RoutedDecoderLayer, route, routers
from lightning_async_pp.models.hf_router_stats import RouterStatistics
from lightning_async_pp.models.hf_structure import prove_cut, refuse_unsupported
from lightning_async_pp.models.training import log_lr_and_throughput, with_lr_schedule
from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses
from lightning_async_pp.runtime.contract import run_layers

try:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'lightning_async_pp.models needs Hugging Face transformers: pip install "lightning-async-pp[hf]" '
        f"(transformers {'>=5.24,<5.25'}). ({error})"
    ) from error

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "phi3", "olmo2")
"""``model_type`` values the tests train through pipelines; others are accepted by their structure when their
cut passes the proof (:mod:`lightning_async_pp.models.hf_structure`; docs/user-guide.md section 11 lists them)."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


# --- checkpoint files -----------------------------------------------------------------------------------


MAX_INDEX_BYTES = 64 * 2**20
"""The largest ``model.safetensors.index.json`` read (a 400B-parameter model's is a few MB)."""


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor names to file names in the index's folder.

    Raises:
        ValueError: If a file is given as a path (a folder, ``..``, an absolute path) rather than a plain name in
            the folder, or the index is not such a map: a folder's index never reaches another file.
    """
    with open(index, "rb") as f:
        text = f.read(MAX_INDEX_BYTES + 1)
    weight_map = json.loads(text).get("weight_map") if len(text) <= MAX_INDEX_BYTES else None
    if type(weight_map) is not dict or not all(type(k) is str for k in weight_map):
        raise ValueError(f"{index} is not a safetensors index: it needs a `weight_map` of tensor names to files.")
    for name, file in weight_map.items():
        if not plain_file_name(file):
            shown = file[:200] if type(file) is str else f"a {type(file).__name__}"
            raise ValueError(
                f"{index} maps {name[:200]!r} to {shown!r}, which is not a file name in {index.parent}: an index "
                "names the safetensors files next to it. Use a folder written by `save_pretrained`."
            )
    return weight_map


class SafetensorsFolder:
    """Lazy, per-key access to the safetensors files of a ``save_pretrained`` folder.

    Only the files that hold a requested key are opened, and only the requested tensors are read.
    ``read`` lists every key read, for tests and logs.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / SAFETENSORS_INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = _weight_map(index)
        elif (self.folder / SAFETENSORS_SINGLE).is_file():
            with safe_open(str(self.folder / SAFETENSORS_SINGLE), framework="pt") as f:
                self.weight_map = {key: SAFETENSORS_SINGLE for key in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.folder} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}. Point `pretrained` at a folder "
                "written by `save_pretrained(..., safe_serialization=True)` (PyTorch .bin files are not read)."
            )
        self.read: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def tensors(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """The tensors stored under the given keys, read from the files that hold them."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.weight_map[key], []).append(key)
        values: dict[str, Tensor] = {}
        for filename, names in by_file.items():
            with safe_open(str(self.folder / filename), framework="pt") as f:
                for key in names:
                    values[key] = f.get_tensor(key)
                    self.read.append(key)
        return values


# --- the LightningModule ----------------------------------------------------------------------------------


def _read_config(
    model_type: str | None, overrides: dict[str, Any], pretrained: str | None
) -> tuple[PretrainedConfig, SafetensorsFolder | None]:
    """The model's ``transformers`` config, from ``model_type`` or a ``pretrained`` folder (then with the folder's
    weights), with ``overrides``; refused if it would run a folder's code or is a model the pipeline cannot cut."""
    if "trust_remote_code" in overrides:
        raise ValueError(
            "`config` cannot set trust_remote_code: lightning_async_pp runs no code from a model folder, only the "
            "models transformers implements itself."
        )
    checkpoint = None
    if pretrained is not None:
        folder = Path(pretrained).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"`pretrained` must be a local folder written by save_pretrained; {folder} has no config.json."
            )
        refuse_custom_code(folder / "config.json")
        hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True, **overrides, trust_remote_code=False)
        checkpoint = SafetensorsFolder(folder)
    else:
        hf_config = AutoConfig.for_model(model_type, **overrides)
    refuse_unsupported(hf_config)
    return hf_config, checkpoint


class CausalLM(LightningModule):
    """A Hugging Face causal language model, ready for pipeline parallelism.

    Give either ``model_type`` with ``config`` (a new model, initialised as ``transformers`` would) or
    ``pretrained`` (a local ``save_pretrained`` folder with safetensors weights). The model is built on the
    meta device; ``configure_model`` (called by the Trainer) materialises it on one device, and a pipeline
    stage materialises only its own layers, reading only their tensors from the files. Outside a Trainer,
    call ``model.configure_model()`` before use.

    Batches are dicts with ``input_ids`` and optionally ``labels`` (default: ``input_ids``; ``-100`` is
    ignored), ``attention_mask`` (1 for tokens, 0 for padding) and ``position_ids``, as in ``transformers``;
    labels are shifted inside the loss. The loss is the token mean over each micro-batch.

    Args:
        model_type: A ``transformers`` decoder-only model type (``"llama"``, ``"gemma"``, ``"phi3"``, ...: those
            whose cut passes the proof; docs/user-guide.md section 11 lists the families tried), or a mixture of
            experts found by its routers and proved with its routers' loss (:mod:`~lightning_async_pp.models.hf_moe`;
            set ``output_router_logits=True`` to train the routers' load-balancing loss, as in ``transformers``).
        config: Keyword arguments of that model type's configuration class (``LlamaConfig`` etc.), e.g.
            ``hidden_size``, ``num_hidden_layers``. With ``pretrained``, overrides of the saved configuration.
        pretrained: A local folder written by ``save_pretrained`` (``config.json`` and safetensors files).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (``transformers``' attention kernels).
        init_seed: Seed of a new model's initialisation; pipeline layer ``i`` is initialised from
            ``init_seed + i``.
        optimizer: Callable that builds the optimizer from ``named_parameters()``; in YAML a
            ``class_path``/``init_args`` pair. Default: ``DelayCorrected(Muon(lr=0.02, adamw_lr=3e-3,
            weight_decay=0.1))``.
        lr_schedule: ``"constant"``, or ``"cosine"``: linear warm-up then cosine decay to ``min_lr_ratio``.
        warmup_fraction: Share of the steps spent in linear warm-up (``"cosine"`` only).
        min_lr_ratio: Final learning rate as a fraction of the peak (``"cosine"`` only).
        compile: Compile each ``transformers`` decoder layer with ``torch.compile``, in place (parameter
            names and checkpoints are unchanged): ``True`` for its defaults (inductor), or a dict of its
            keyword arguments (``{"backend": "aot_eager"}``). The masks and rotary tables are built outside
            the compiled code, once per stage and micro-batch. See :mod:`lightning_async_pp.models.compiling`.

    Raises:
        ValueError: For unsupported architectures (multimodal, cross-attention, a base model without the
            decoder-only structure, a cut whose logits, or a mixture of experts whose objective and gradients,
            differ from ``transformers``' own on a small copy: :mod:`~lightning_async_pp.models.hf_structure`), or
            when neither or both of ``model_type`` and ``pretrained`` are given.
    """

    def __init__(
        self,
        model_type: str | None = None,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
        init_seed: int = 0,
        optimizer: OptimizerCallable | None = None,
        lr_schedule: Literal["constant", "cosine"] = "cosine",
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.1,
        compile: CompileOption = False,
    ) -> None:
        super().__init__()
        if (model_type is None) == (pretrained is None):
            raise ValueError(
                "Give CausalLM either `model_type` (with `config`, for a new model) or `pretrained` (a local "
                f"save_pretrained folder), not {'both' if model_type else 'neither'}."
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        hf_config, self.checkpoint = _read_config(model_type, dict(config or {}), pretrained)
        hf_config._attn_implementation = attn_implementation
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=attn_implementation, trust_remote_code=False
            )
        model.train()
        # The `transformers` model is kept outside the module tree: its modules live on in the pipeline layers,
        # which are the only registered owners of the parameters (a stage drops the layers it does not run).
        self._hf = [model]
        self.hf_config = model.config
        self.tied = (
            bool(self.hf_config.tie_word_embeddings) if hasattr(self.hf_config, "tie_word_embeddings") else False
        )
        self.tied = self.tied and model.get_output_embeddings().weight is model.get_input_embeddings().weight
        layers = split_layers(model)
        self.proof_seconds = prove_cut(self.hf_config, pipeline_of)  # before any worker starts; 0 once proved
        compile_blocks((layer.layer for layer in layers if isinstance(layer, DecoderLayer)), compile)
        layers, self.router_loss = route(layers, model)  # a mixture of experts' decoders carry router totals
        self.objective = Objective(model, self.router_loss)
        sparse = [i - 1 for i, layer in enumerate(layers) if isinstance(layer, RoutedDecoderLayer) and layer.sparse]
        self.router_statistics = RouterStatistics(sparse)  # rows added by the last stage, logged once per step
        self.layers = nn.ModuleList(layers)
        hf_names: dict[int, list[str]] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():  # persistent buffers too (DeepSeek's bias)
            hf_names.setdefault(id(tensor), []).append(name)
        self._hf_names = {name: hf_names[id(t)] for name, t in self.state_dict(keep_vars=True).items()}
        # The folder's tensors under the model's names, through transformers' own key conversions.
        self.stored = (
            None if self.checkpoint is None else StoredTensors(model, self.checkpoint.weight_map, self.checkpoint)
        )
        self._batch_start: float | None = None

    # --- names -------------------------------------------------------------------------------------------

    def hf_name(self, name: str) -> str:
        """The ``transformers`` parameter name of one of this module's parameters (``"layers.1.layer.mlp..."``)."""
        return self._hf_names[name][0]

    def hf_state_dict(self) -> dict[str, Tensor]:
        """This process's parameters and persistent buffers under their ``transformers`` names (load them with
        ``load_state_dict``)."""
        return {
            self.hf_name(name): param.detach()
            for name, param in self.state_dict(keep_vars=True).items()
            if not param.is_meta
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the ``transformers`` configuration and names, so that a consolidated checkpoint can be written
        as a ``save_pretrained`` folder (``python -m lightning_async_pp consolidate``, :func:`save_pretrained`)."""
        checkpoint[TRANSFORMERS_KEY] = {
            "config": self.hf_config.to_json_string(),  # a string: the checkpoint loads with weights_only=True
            "names": {name: list(names) for name, names in self._hf_names.items()},
        }

    # --- materialising ---------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Materialise every layer on this module's device, unless the strategy builds stages on the meta device."""
        if torch.empty(0).is_meta or MetaLayers.active():
            return  # a pipeline stage: the strategy materialises only its own layers
        device = self.device if self.device.type != "meta" else torch.device("cpu")
        self._materialize_all(device)

    def _materialize_all(self, device: torch.device) -> None:
        for index, layer in enumerate(self.layers):
            if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
                layer.to_empty(device=device)
                self.reset_pipeline_layer(index, layer)

    @torch.no_grad()
    def reset_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        """Initialise (or load) one materialised pipeline layer, exactly as the whole model would be."""
        self._retie(layer)
        if self.checkpoint is None:
            self._initialize(index, layer)
        else:
            self._initialize(index, layer, buffers_only=True)
            self._load(layer)

    def _retie(self, layer: nn.Module) -> None:
        # `to_empty` gives each materialised layer new parameters; the head takes the embedding's again once
        # both are materialised in this process (not before: materialising the head would empty the shared
        # tensor in place).
        if not self.tied:
            return
        embedding, head = self.layers[0], self.layers[-1]
        if isinstance(embedding, Embedding) and isinstance(head, Head) and layer in (embedding, head):
            if not embedding.embed_tokens.weight.is_meta and not head.norm.weight.is_meta:
                head.lm_head.weight = embedding.embed_tokens.weight

    def _initialize(self, index: int, layer: nn.Module, buffers_only: bool = False) -> None:
        model = self._hf[0]
        device = next(iter((*layer.parameters(), *layer.buffers())), torch.empty(0)).device
        # Initialise on the CPU from the layer's own seed, so the weights do not depend on the device or on
        # which other layers this process holds; children before parents, as transformers does.
        shadow = copy.deepcopy(layer).to("cpu") if device.type != "cpu" else layer
        # A tied head keeps the embedding's values (on another stage, the tie copies them over): the first
        # layer that uses a tied weight initialises it. transformers' init functions skip flagged tensors.
        keep = [shadow.lm_head.weight] if self.tied and isinstance(shadow, Head) else []
        if buffers_only:  # weights read from a checkpoint: only computed buffers (rotary tables, Gemma's scale)
            keep = list(shadow.parameters())
        for tensor in keep:
            tensor._is_hf_initialized = True
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.hparams.init_seed + index)
            for module in _post_order(shadow):
                model._init_weights(module)
        for tensor in keep:
            del tensor._is_hf_initialized
        if shadow is not layer:
            for target, source in zip(
                (*layer.parameters(), *layer.buffers()), (*shadow.parameters(), *shadow.buffers())
            ):
                target.copy_(source)
        if self.tied and isinstance(layer, Embedding) and isinstance(self.layers[-1], Head):
            self._retie(self.layers[-1])

    def _load(self, layer: nn.Module) -> None:
        assert self.checkpoint is not None and self.stored is not None
        prefix = next(name for name, module in self.named_modules() if module is layer)
        wanted: dict[str, Tensor] = {}
        for name, param in layer.state_dict(prefix=f"{prefix}.", keep_vars=True).items():  # persistent buffers too
            if self.tied and isinstance(layer, Head) and name.endswith("lm_head.weight"):
                embedding = self.layers[0]
                if isinstance(embedding, Embedding) and embedding.embed_tokens.weight is param:
                    continue  # the embedding's tensor, loaded with the embedding
                # On a stage without the embedding, the head's copy reads the embedding's stored tensor.
            key = next((n for n in self._hf_names[name] if n in self.stored), None)
            if key is None:
                raise KeyError(
                    f"{self.checkpoint.folder} has no tensor for {self._hf_names[name][0]} (parameter {name}), "
                    f"under that name or any that transformers' key conversions for {self.hf_config.model_type} "
                    "turn into it. The folder's weights do not match its config.json."
                )
            wanted[key] = param
        self.stored.load(wanted)

    # --- pipeline contract -----------------------------------------------------------------------------

    def pipeline_layers(self) -> Sequence[nn.Module]:
        return self.layers

    def pipeline_inputs(self, batch: Any) -> Tensor:
        return input_ids(batch)

    def pipeline_loss(self, output: Tensor | tuple[Tensor, ...], batch: Any) -> Tensor:
        """The language-model loss; for a mixture-of-experts model whose output carries the routers' totals
        (:mod:`~lightning_async_pp.models.hf_moe`), with the load-balancing loss's gradient attached to it."""
        labels = batch_value(batch, "labels")
        if self.training and isinstance(output, tuple):
            self.router_statistics.add(output[-1])  # what each sparse layer's routing did (hf_router_stats)
        return self.objective(output, input_ids(batch) if labels is None else labels)

    def pipeline_validation_step(self, output: Tensor, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.pipeline_loss(output, batch), prog_bar=True)

    # --- plain LightningModule -------------------------------------------------------------------------

    def forward(self, batch: Any) -> Tensor:
        """Logits of a batch (a dict with ``input_ids``, or a tensor of ids)."""
        output = run_layers(self.layers, input_ids(batch), batch)
        return output if isinstance(output, Tensor) else output[0]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        with AuxiliaryLosses(1 / self.trainer.accumulate_grad_batches) as aux:
            loss = self.pipeline_loss(run_layers(self.layers, input_ids(batch), batch), batch)
        self.log("train/loss", loss, prog_bar=True)
        if aux.total() is not None:
            self.log("train/aux_loss", aux.total())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_validation_step(run_layers(self.layers, input_ids(batch), batch), batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        log_lr_and_throughput(self, input_ids(batch).numel(), self._batch_start)
        for name, value in self.router_statistics.metrics().items():  # device tensors: no host sync here
            self.log(name, value, on_step=True, on_epoch=False)

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            from lightning_async_pp.optim import DelayCorrected, Muon

            optimizer = DelayCorrected(Muon(self, lr=0.02, adamw_lr=3e-3, weight_decay=0.1))  # module: experts found
        else:
            optimizer = self.optimizer_factory(self.named_parameters())
        return with_lr_schedule(optimizer, self)


def save_pretrained(checkpoint: Mapping[str, Any], folder: str | Path) -> Path:
    """Write a whole :class:`CausalLM` checkpoint as a ``transformers`` ``save_pretrained`` folder.

    The folder holds ``config.json`` and the weights in safetensors files, under the ``transformers`` names;
    a tied head is stored once, as ``transformers`` stores it. ``AutoModelForCausalLM.from_pretrained(folder)``
    loads it on one device, and ``CausalLM(pretrained=folder)`` continues training from it.

    Args:
        checkpoint: A checkpoint with the whole model's ``state_dict`` (a consolidated one, see
            :func:`lightning_async_pp.checkpoint.consolidate`) written while training a :class:`CausalLM`.
        folder: The folder to write (created if missing).

    Returns:
        The folder.

    Raises:
        ValueError: If the checkpoint was not written by a :class:`CausalLM`, or lacks some of its weights.
    """
    info = checkpoint.get(TRANSFORMERS_KEY)
    if info is None:
        raise ValueError(
            "This checkpoint was not saved by lightning_async_pp.models.CausalLM (it has no "
            f"{TRANSFORMERS_KEY!r} entry), so it has no transformers configuration to write a save_pretrained folder."
        )
    settings = json.loads(info["config"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    weights: dict[str, Tensor] = {}
    for name, tensor in checkpoint["state_dict"].items():
        for hf_name in info["names"].get(name, ()):
            held = weights.setdefault(hf_name, tensor)
            if held is not tensor and not torch.equal(held, tensor):
                raise ValueError(
                    f"The checkpoint holds two different values for the tied weight {hf_name}; its copies "
                    "were not kept equal. It cannot be written as one transformers model."
                )
    expected = set(model.state_dict())
    missing = sorted(expected - set(weights))
    if missing:
        raise ValueError(
            f"The checkpoint has no weights for {missing[:6]}{' ...' if len(missing) > 6 else ''}: it does not "
            "hold the whole model. Consolidate a checkpoint directory written by the whole pipeline."
        )
    model.load_state_dict({k: v for k, v in weights.items() if k in expected}, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # one tensor again, which save_pretrained stores once
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model.config.dtype = dtypes.pop()  # from_pretrained's "auto" dtype reads it
    # Built on the meta device with the checkpoint's tensors assigned: no second copy of the weights in memory.
    # Its non-persistent buffers (rotary tables) stay on meta; from_pretrained computes them again.
    model.save_pretrained(str(folder))
    return Path(folder)


def pipeline_of(model: nn.Module) -> tuple[list[nn.Module], Objective | None]:
    """The pipeline layers of a ``transformers`` causal LM, and, for a mixture of experts, the objective they are
    trained on (the proof of the cut checks it against ``.loss``; ``None`` for a dense model)."""
    layers, router_loss = route(split_layers(model), model)
    return layers, Objective(model, router_loss) if routers(model) else None


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


__all__ = ["CausalLM", "SUPPORTED", "SafetensorsFolder", "Embedding", "DecoderLayer", "Head", "save_pretrained"]
