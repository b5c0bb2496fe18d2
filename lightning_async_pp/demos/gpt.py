"""A byte-level GPT small enough to read in one sitting, and cut into pipeline stages block by block.

The model is a flat sequence of layers, ``[Embedding, Block, ..., Block, Head]``, each a module that maps
one tensor to one tensor. That is the whole pipeline contract (see
:mod:`lightning_async_pp.runtime.contract`): a pipeline places consecutive layers on consecutive stages and
streams activations between them. With ``tie_weights=True`` the output head reuses the token embedding
matrix, as GPT-2 does; the two usually land on the first and the last stage, which then each keep a copy
that the strategy keeps identical (see :mod:`lightning_async_pp.runtime.ties`).

Every layer is initialised from its own seed (``init_seed + layer index``), so a stage that builds only its
own layers gets exactly the weights the whole model would have.

With ``n_experts > 0`` each block's MLP is a mixture of experts (:class:`MoE`): a router picks
``experts_per_token`` of ``n_experts`` MLPs for each token, and a load-balancing loss keeps the router from
sending every token to the same few. That loss is attached to the block's output
(:func:`~lightning_async_pp.runtime.auxiliary.attach_auxiliary_loss`), so its gradient joins the backward
on the stage that holds the router and no loss value travels down the pipeline. Every expert of a block lives
on that block's stage (no expert parallelism).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from lightning_async_pp.models.compiling import CompileOption, compile_blocks
from lightning_async_pp.models.training import log_lr_and_throughput, with_lr_schedule
from lightning_async_pp.module import PipelineModule
from lightning_async_pp.runtime.auxiliary import attach_auxiliary_loss

Batch = tuple[Tensor, Tensor]


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` byte ids to ``(B, T, C)`` activations."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def mlp(n_embd: int) -> nn.Sequential:
    """The 4x MLP of a dense block, and of each expert of a mixture."""
    return nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))


class MoE(nn.Module):
    """A mixture of ``n_experts`` MLPs, ``experts_per_token`` of them per token, with a load-balancing loss.

    Routing: a softmax over all experts of the router's logits; each token goes to its ``experts_per_token``
    most probable experts, whose outputs are weighted by those probabilities as they are (not renormalised
    over the chosen ones, as in the Switch Transformer and Qwen2-MoE's default), so the router also learns
    from the language-model loss when one expert is chosen per token.

    Each expert is its own module (Muon orthogonalizes each expert's matrices as separate matrices). Routing is a
    dense dispatch: every expert runs on every token of the micro-batch, and each token sums its experts' outputs
    weighted by a gate that is its probability for the ``experts_per_token`` chosen experts and 0 for the others.
    Nothing about the routing is read on the host (how many tokens an expert got would be a host-device
    synchronisation per layer and forward), shapes do not depend on the routing, and an expert that no token
    chose still gets its (zero) gradient. The price is compute: ``n_experts / experts_per_token`` times the FLOPs
    of running each expert on its own tokens only, which the ``plan`` command and the MFU count as run.

    Load balancing (Switch Transformer, Megatron-LM): ``n_experts * sum_e f_e * P_e`` over the tokens of the
    micro-batch, where ``f_e`` is the share of the token-expert assignments that went to expert ``e`` and
    ``P_e`` the mean router probability of ``e``; it is 1 when routing is uniform. Its gradient, times
    ``aux_loss_coef``, is attached to the output.

    Args:
        n_embd: Width of the residual stream.
        n_experts: Number of experts.
        experts_per_token: Experts each token is sent to (top-k).
        aux_loss_coef: Weight of the load-balancing loss in the training objective.
    """

    def __init__(self, n_embd: int, n_experts: int, experts_per_token: int, aux_loss_coef: float) -> None:
        super().__init__()
        self.experts_per_token = experts_per_token
        self.aux_loss_coef = aux_loss_coef
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList([mlp(n_embd) for _ in range(n_experts)])

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.experts_per_token, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, chosen, weights)  # (tokens, experts): 0 where not chosen
        outputs = torch.stack([expert(tokens) for expert in self.experts], dim=1)  # (tokens, experts, n_embd)
        y = (outputs * gates.unsqueeze(-1).to(outputs.dtype)).sum(dim=1).view_as(x)
        assigned = torch.zeros_like(probs).scatter(1, chosen, 1.0)  # each token's chosen experts, counted on device
        share = assigned.sum(dim=0) / chosen.numel()
        balance = len(self.experts) * (share * probs.mean(dim=0)).sum()
        return attach_auxiliary_loss(y, balance, weight=self.aux_loss_coef)


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x MLP (or a mixture of them), each on a residual branch."""

    def __init__(
        self, n_embd: int, n_head: int, n_experts: int = 0, experts_per_token: int = 2, aux_loss_coef: float = 0.01
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MoE(n_embd, n_experts, experts_per_token, aux_loss_coef) if n_experts else mlp(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and the projection to byte logits."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln(x))


def init_layer(layer: nn.Module, seed: int, keep: Sequence[Tensor] = ()) -> None:
    """GPT-2 style initialisation of one layer from its own seed (N(0, 0.02) weights, zero biases).

    Args:
        layer: The layer.
        seed: Its seed.
        keep: Weights to leave as they are (a tied weight that an earlier layer initialises).
    """
    if any(p.is_meta for p in layer.parameters()):
        return  # built on the meta device: the pipeline stage that owns the layer initialises it
    generator = torch.Generator(device="cpu").manual_seed(seed)
    keep_ids = {id(t) for t in keep}
    for module in layer.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in keep_ids:
            weight = torch.randn(module.weight.shape, generator=generator) * 0.02
            with torch.no_grad():
                module.weight.copy_(weight.to(module.weight.device))
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class GPT(PipelineModule):
    """Byte-level GPT language model, ready for pipeline parallelism.

    A :class:`~lightning_async_pp.PipelineModule`: ``forward`` and the ``*_step`` methods follow from the
    pipeline contract, so the same module trains with or without ``AsyncPipelineStrategy``.

    Args:
        vocab_size: Number of token ids (256 for bytes).
        block_size: Context length in tokens; also the largest sequence the position embedding accepts.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block.
        n_embd: Width of the residual stream.
        init_seed: Seed of the weight initialisation; layer ``i`` is initialised from ``init_seed + i``.
        optimizer: Callable that builds the optimizer from ``named_parameters()``. In YAML, a
            ``class_path``/``init_args`` pair. Defaults to ``AdamW(lr=1e-3, weight_decay=0.1)``.
        lr_schedule: ``"constant"``, or ``"cosine"``: linear warm-up then cosine decay to
            ``min_lr_ratio`` of the peak, over the trainer's estimated number of steps.
        warmup_fraction: Share of the steps spent in linear warm-up (``"cosine"`` only).
        min_lr_ratio: Final learning rate as a fraction of the peak (``"cosine"`` only).
        tie_weights: The output head's matrix is the token embedding's (one parameter, initialised by the
            embedding). In a pipeline the first and last stages each hold a copy, kept identical.
        compile: Compile each transformer block with ``torch.compile``, in place (parameter names and
            checkpoints are unchanged): ``True`` for its defaults (inductor), or a dict of its keyword
            arguments (``{"backend": "aot_eager"}``). See :mod:`lightning_async_pp.models.compiling`.
        n_experts: ``0``: each block has one MLP. Otherwise each block's MLP is a mixture of this many
            experts (:class:`MoE`), each the size of the dense MLP.
        experts_per_token: Experts each token is sent to (top-k), at most ``n_experts``.
        aux_loss_coef: Weight of the routers' load-balancing loss, which trains with the language-model loss
            and is logged as ``train/aux_loss`` (the sum over blocks, without this weight).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        init_seed: int = 0,
        optimizer: OptimizerCallable | None = None,
        lr_schedule: Literal["constant", "cosine"] = "cosine",
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.1,
        tie_weights: bool = False,
        compile: CompileOption = False,
        n_experts: int = 0,
        experts_per_token: int = 2,
        aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        if n_experts < 0 or (n_experts and not 1 <= experts_per_token <= n_experts):
            raise ValueError(
                f"Got n_experts={n_experts} and experts_per_token={experts_per_token}: n_experts must be 0 (dense"
                " MLPs) or positive, and experts_per_token between 1 and n_experts."
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.layers = nn.ModuleList(
            [Embedding(vocab_size, block_size, n_embd)]
            + [Block(n_embd, n_head, n_experts, experts_per_token, aux_loss_coef) for _ in range(n_layer)]
            + [Head(n_embd, vocab_size)]
        )
        if tie_weights:
            self.layers[-1].lm_head.weight = self.layers[0].tok.weight
        self.reset_parameters()
        compile_blocks(self.layers[1:-1], compile)
        self.val_loss, self.val_perplexity = MeanMetric(), Perplexity()
        self.test_loss, self.test_perplexity = MeanMetric(), Perplexity()
        self._batch_start: float | None = None

    def reset_parameters(self) -> None:
        for index, layer in enumerate(self.layers):
            self.reset_pipeline_layer(index, layer)

    # --- pipeline contract -------------------------------------------------------------------------

    def pipeline_layers(self) -> Sequence[nn.Module]:
        return self.layers

    def pipeline_inputs(self, batch: Batch) -> Tensor:
        return batch[0]

    def pipeline_loss(self, output: Tensor, batch: Batch) -> Tensor:
        targets = batch[1]
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))

    def reset_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        # A tied head keeps the embedding's values: the first layer that uses a tied weight initialises it.
        tied_head = self.hparams.tie_weights and index == len(self.layers) - 1
        init_layer(layer, self.hparams.init_seed + index, keep=[layer.lm_head.weight] if tied_head else ())

    def pipeline_validation_step(self, output: Tensor, batch: Batch, batch_idx: int) -> None:
        self.evaluation_metrics("val", self.val_loss, self.val_perplexity, output, batch)

    def pipeline_test_step(self, output: Tensor, batch: Batch, batch_idx: int) -> None:
        self.evaluation_metrics("test", self.test_loss, self.test_perplexity, output, batch)

    def evaluation_metrics(
        self, prefix: str, loss: MeanMetric, perplexity: Perplexity, logits: Tensor, batch: Batch
    ) -> None:
        """Update and log ``{prefix}/loss`` (per token) and ``{prefix}/perplexity`` from the logits of one batch."""
        loss.update(self.pipeline_loss(logits, batch), weight=batch[1].numel())
        perplexity.update(logits.float(), batch[1])
        self.log(f"{prefix}/loss", loss, prog_bar=prefix == "val")
        self.log(f"{prefix}/perplexity", perplexity)

    # --- logging ------------------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        log_lr_and_throughput(self, batch[0].numel(), self._batch_start)

    def optimizer_parameters(self) -> list[tuple[str, Tensor]] | list[dict[str, Any]]:
        """What ``configure_optimizers`` hands the optimizer: ``named_parameters()`` pairs, or with experts
        two groups of them, the routers' weights in the second with ``"use_muon": False``.

        A router's ``(n_experts, n_embd)`` weight is 2-D and no default name pattern of
        :class:`~lightning_async_pp.optim.Muon` matches it, so Muon would orthogonalize it. But, like the
        output head, it produces logits over a handful of choices, not hidden features: orthogonalizing its
        update (``n_experts`` orthonormal rows) would give every expert's row the same step, whatever its
        gradient: a rarely chosen expert's scores would move as fast as a busy one's. So it goes to Muon's
        AdamW part, as the head does. Other optimizers ignore the group's ``use_muon`` key.
        """
        routers = {id(m.router.weight) for m in self.modules() if isinstance(m, MoE)}
        named = list(self.named_parameters())
        if not routers:
            return named
        groups = [
            {"params": [(n, p) for n, p in named if id(p) not in routers]},
            {"params": [(n, p) for n, p in named if id(p) in routers], "use_muon": False},
        ]
        # A pipeline stage without a router (the embedding's, the head's) gets one group, as a dense model does.
        return [group for group in groups if group["params"]]

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            optimizer = torch.optim.AdamW(self.optimizer_parameters(), lr=1e-3, weight_decay=0.1)
        else:
            optimizer = self.optimizer_factory(self.optimizer_parameters())
        return with_lr_schedule(optimizer, self)
