"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_async_pp.optim.muon_parts import AdamWPart, MatrixMuon
from lightning_async_pp.optim.muon_routing import (
    DEFAULT_ADAMW_PATTERNS,
    DEFAULT_EXPERT_PATTERNS,
    EXPERT_VECTORS,
    ROUTER,
    ExpertStack,
    describe_experts,
    expert_roles,
    holders,
    module_classes,
    patterns,
)
from lightning_async_pp.optim.newton_schulz import (  # the precision switch is importable from here too
    check_ns_batch_bytes,
    check_ns_dtype,
    newton_schulz_dtype,
    use_float32_newton_schulz,
)

__all__ = [
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EXPERT_PATTERNS",
    "Muon",
    "newton_schulz_dtype",
    "use_float32_newton_schulz",
]


def _empty_optimizer(cls: type[Optimizer], **kwargs: Any) -> Optimizer:
    # torch optimizers refuse an empty parameter list but accept an empty group. Dropping that group
    # leaves an optimizer whose groups are exactly the ones `Muon` hands to it, and whose constructor
    # has validated `kwargs` and filled `defaults` with every key its `step` reads.
    optimizer = cls([{"params": []}], **kwargs)
    optimizer.param_groups.clear()
    return optimizer


class Muon(Optimizer):
    r"""Muon on hidden weight matrices and convolution kernels, AdamW on all other parameters, as one optimizer.

    Muon (`Jordan et al., 2024 <https://kellerjordan.github.io/posts/muon/>`_) replaces each matrix update
    by an orthogonalized Nesterov momentum (Newton-Schulz iteration). It only makes sense for the weights of
    hidden layers; embeddings, the output layer, norms and biases are optimized with AdamW. The matrix math is
    :class:`torch.optim.Muon`'s and the rest is :class:`torch.optim.AdamW`'s: this class holds one of each,
    and their ``param_groups`` are the very dicts in :attr:`param_groups`, each tagged with ``use_muon``.
    Learning-rate schedulers, which edit ``param_groups[i]["lr"]``, therefore act on both parts; the AdamW
    groups start from ``adamw_lr``, so a multiplicative schedule scales both parts alike.

    A convolution kernel (a tensor of more than 2 dims, e.g. ``(out_channels, in_channels, k)``) is updated
    as the matrix ``(out_channels, in_channels x k)``, the way Muon's reference implementation treats conv
    filters: parameter, gradient and momentum are reshaped into that matrix for :class:`torch.optim.Muon`'s
    step and the update lands in the kernel. ``muon_kernels=False`` keeps kernels on AdamW.

    The step is batched (``batched=True``, the default): the matrices are grouped by their shape with rows
    and columns in increasing order (a tall matrix is iterated transposed, as :class:`torch.optim.Muon` does,
    so it joins its transpose), device, dtype and iteration settings, and each group runs the Newton-Schulz
    iteration as batched matrix products on a stack of its matrices, in chunks of at most ``ns_batch_bytes``;
    momentum, Nesterov, weight decay and the update, and the AdamW part's step, are multi-tensor
    (``torch._foreach_*``) operations. Each matrix gets torch's per-matrix arithmetic (on CPU, the same bits).
    With a GPU's batches, a GPT with 24 blocks takes 103 operations for its 96 hidden matrices instead of
    2,694, which on a GPU are as many kernel launches. ``batched=False`` runs :class:`torch.optim.Muon`'s and
    :class:`torch.optim.AdamW`'s own loops, tensor by tensor.

    Experts stacked ``(experts, rows, cols)`` (as ``transformers`` 5 stores them) in a module matching
    ``expert_patterns`` (or, given the model, whose ``num_experts`` is the first dim) are orthogonalized expert by
    expert, batched with the other matrices, each with its own shape's learning-rate scale; a fused
    ``gate_up_proj`` as gate and up where its layout is known. Routers: AdamW. In full: docs/optimizers.md.

    Routing, for each parameter (first rule that applies):

    1. in a parameter-group dict with ``"use_muon": True`` / ``False``: that part;
    2. fewer than 2 dims (biases, norms), a router, the experts' biases: AdamW;
    3. more than 2 dims and not a stack of experts: AdamW if ``muon_kernels`` is off or its first dim is 1 (a
       token or position embedding such as a ViT's ``cls_token``, not a kernel);
    4. its name matches one of ``adamw_patterns`` (:func:`fnmatch.fnmatchcase` on the full dotted name;
       needs names: ``named_parameters()`` pairs or a module): AdamW;
    5. the module that holds it is an instance of one of ``adamw_modules`` (needs ``params`` to be the
       module): AdamW;
    6. otherwise Muon.

    A part may be empty, e.g. on a pipeline stage that holds only the embedding. :meth:`describe_routing`
    says in one line where the parameters went.

    Args:
        params: Tensors, ``(name, tensor)`` pairs (e.g. ``module.named_parameters()``), parameter-group dicts,
            or a module (routed as its ``named_parameters()``, and by module type with ``adamw_modules``).
        lr: Muon learning rate, before :class:`torch.optim.Muon`'s shape adjustment (see ``adjust_lr_fn``).
        weight_decay: Decoupled weight decay of the Muon part.
        momentum: Muon momentum.
        nesterov: Whether Muon uses Nesterov momentum.
        ns_coefficients: Coefficients ``(a, b, c)`` of the Newton-Schulz polynomial.
        eps: Muon's guard against division by zero when normalizing the momentum.
        ns_steps: Number of Newton-Schulz iterations.
        adjust_lr_fn: ``None`` or ``"original"`` scales the learning rate by
            :math:`\sqrt{\max(1, \text{rows}/\text{cols})}`; ``"match_rms_adamw"`` by
            :math:`0.2\sqrt{\max(\text{rows}, \text{cols})}`, which lets Muon reuse an AdamW learning rate.
            Kernels count as their matrix ``(out_channels, in_channels x kernel)``.
        adamw_lr: Learning rate of the AdamW part.
        adamw_betas: AdamW's ``(beta1, beta2)``.
        adamw_eps: AdamW's ``eps``.
        adamw_weight_decay: Decoupled weight decay of the AdamW part.
        adamw_patterns: ``fnmatch`` patterns of parameter names that go to AdamW although they are matrices.
            Only used for named parameters in groups without ``use_muon``.
        adamw_modules: Module classes, or their import paths (``"torch.nn.Embedding"``), whose own parameters
            go to AdamW although they are matrices. Only used when ``params`` is a module.
        muon_kernels: Whether convolution kernels get Muon (flattened to matrices) or AdamW.
        expert_patterns: ``fnmatch`` patterns of the names of the modules that hold experts' weights stacked.
        muon_routers: Whether the routers of mixture-of-experts layers get Muon or AdamW.
        ns_dtype: Precision of the Newton-Schulz products: ``"auto"`` (bfloat16 on CUDA, float32 elsewhere, see
            :func:`~lightning_async_pp.optim.newton_schulz.auto_newton_schulz_dtype`; inside a
            :func:`~lightning_async_pp.optim.newton_schulz.newton_schulz_dtype` block, that block's),
            ``"float32"`` or ``"bfloat16"`` (:class:`torch.optim.Muon`'s iteration).
        batched: Whether the step works on many tensors at once (see above) or tensor by tensor.
        ns_batch_bytes: Upper bound of one Newton-Schulz batch: its stack of matrices in the Newton-Schulz
            precision (a matrix larger than that is a batch of its own). A batch's products and temporaries take
            about five times as much memory while it runs. ``None``:
            :func:`~lightning_async_pp.optim.newton_schulz.auto_ns_batch_bytes`, 128 MiB on a GPU (16 of
            GPT-2-medium's ``1024 x 4096`` matrices in a bfloat16 batch: products large enough that a GPU spends
            its time computing rather than launching, at a few hundred MiB of temporaries) and 4 MiB on CPU (a
            cache's worth).

    Raises:
        ValueError: If a hyperparameter is out of range, if a group with ``"use_muon": True`` contains a
            parameter with fewer than 2 dims, or if the parameter list is empty.
        TypeError: If ``adamw_modules`` is given without a module to look the types up in, or names something
            that is not a module class.

    Example::

        optimizer = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
        optimizer = Muon(model, lr=0.02, adamw_modules=[nn.Embedding], adamw_patterns=["classifier.*"])
    """

    per_parameter = True
    """Each parameter's update reads only its own gradient and state (Muon's orthogonalization is per matrix)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]] | nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.1,
        adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS,
        adamw_modules: Sequence[str | type] = (),
        muon_kernels: bool = True,
        expert_patterns: Sequence[str] = DEFAULT_EXPERT_PATTERNS,
        muon_routers: bool = False,
        ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto",
        batched: bool = True,
        ns_batch_bytes: int | None = None,
    ) -> None:
        check_ns_batch_bytes(ns_batch_bytes)
        self.adamw_patterns = patterns("adamw_patterns", adamw_patterns)
        self.expert_patterns = patterns("expert_patterns", expert_patterns)
        self.adamw_modules = module_classes(adamw_modules)
        self.muon_kernels, self.muon_routers = bool(muon_kernels), bool(muon_routers)
        self._roles: dict[Tensor, str] = {}  # routers and experts' vectors, for the routing line
        # Which module holds each parameter, for `adamw_modules` and experts; only known when given the module.
        params, self._holder = holders(params, by_module=bool(self.adamw_modules))
        self._muon = _empty_optimizer(
            MatrixMuon,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self._muon.ns_dtype = check_ns_dtype(ns_dtype)
        self._muon.batched = bool(batched)
        self._muon.ns_batch_bytes = ns_batch_bytes
        self._adamw = _empty_optimizer(
            AdamWPart, lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        self._adamw.batched = bool(batched)
        defaults = {
            **self._muon.defaults,
            "adamw_lr": adamw_lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults)
        self._holder = {}  # routing is done; keep no second reference to the modules
        self._share_with_parts()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, split into a Muon and an AdamW group unless it sets ``use_muon``.

        Args:
            param_group: ``{"params": ..., **options}``. ``"use_muon"`` (``True``/``False``) sends all its
                parameters to one part; without it they are routed by the rules of the class docstring.

        Raises:
            ValueError: If ``"use_muon"`` is ``True`` and a parameter has fewer than 2 dims.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the ordering of tensors"
                " in sets will change between runs. Please use a list instead."
            )
        else:
            params = list(params)
        options = {key: value for key, value in param_group.items() if key != "params"}

        use_muon = options.pop("use_muon", None)
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
        roles = expert_roles(named, self._holder, self.expert_patterns)
        if use_muon is None:
            to_muon = [self._routes_to_muon(p, roles.get(i)) for i, p in enumerate(params)]
            muon_params = [p for p, muon in zip(params, to_muon) if muon]
            adamw_params = [p for p, muon in zip(params, to_muon) if not muon]
        elif use_muon:
            for index, param in enumerate(params):
                name, tensor = param if isinstance(param, tuple) else (None, param)
                if tensor.ndim < 2:
                    label = repr(name) if name is not None else f"at index {index} of its group"
                    raise ValueError(
                        f"Muon only updates weight matrices and kernels (2 or more dims), but the parameter {label}"
                        f" has shape {tuple(tensor.shape)} and is in a group with `use_muon=True`. Move it to a"
                        " group with `use_muon=False` (AdamW), or drop `use_muon` from the group to route by shape."
                    )
            muon_params, adamw_params = params, []
        else:
            muon_params, adamw_params = [], params
        self._keep_roles(named, roles, muon_params)

        parts = [(True, muon_params, self._muon), (False, adamw_params, self._adamw)]
        # A group given without parameters stays a (empty) group, so that group counts match the user's view.
        if not params:
            parts = [part for part in parts if part[0] == bool(use_muon)]
        for muon_part, part_params, part in parts:
            if not part_params and params:
                continue
            group = {**options, "params": part_params, "use_muon": muon_part}
            self._check_disjoint_and_naming(group)
            part.add_param_group(group)
            self.param_groups.append(group)

    def _keep_roles(self, named: list[tuple[Any, Tensor]], roles: dict[int, Any], muon_params: list[Any]) -> None:
        # The Muon part cuts the stacks it steps; the routing line names the routers.
        on_muon = {id(p[1] if isinstance(p, tuple) else p) for p in muon_params}
        for index, role in roles.items():
            tensor = named[index][1]
            if not isinstance(role, ExpertStack):
                self._roles[tensor] = role
            elif id(tensor) in on_muon:
                self._muon.expert_stacks[tensor] = role

    def _routes_to_muon(self, param: Tensor | tuple[str, Tensor], role: ExpertStack | str | None) -> bool:
        name, tensor = param if isinstance(param, tuple) else (None, param)
        if tensor.ndim < 2 or role == EXPERT_VECTORS or (role == ROUTER and not self.muon_routers):
            return False
        is_kernel = tensor.ndim > 2 and not isinstance(role, ExpertStack)
        if is_kernel and (not self.muon_kernels or tensor.shape[0] == 1):
            return False
        if name is not None and any(fnmatchcase(name, pattern) for pattern in self.adamw_patterns):
            return False
        holder = self._holder.get(tensor)
        return not (holder is not None and isinstance(holder, self.adamw_modules))

    def routing(self) -> dict[str, Any]:
        """Where the parameters went: per part the number of tensors and of elements, the number of kernels
        on Muon, and the names of the matrices and kernels on AdamW (``"#i"`` for unnamed tensors, ``i``
        counting over all of this optimizer's parameters), ``ns_dtype``: the precision the next step's
        Newton-Schulz runs in (``None`` when the Muon part is empty), and ``ns_groups`` and ``ns_batches``: the
        groups of matrices it orthogonalizes together and the batches (chunks of at most ``ns_batch_bytes``)
        they take, both ``None`` with ``batched=False``.

        Experts: ``muon_expert_stacks`` (also in ``muon_tensors``), ``muon_expert_matrices``, ``experts`` (their
        numbers) and ``routers``, ``{"adamw": names, "muon": names}`` (not in ``adamw_matrices``)."""
        out: dict[str, Any] = {
            "muon_tensors": 0,
            "muon_numel": 0,
            "muon_kernels": 0,
            "muon_expert_stacks": 0,
            "muon_expert_matrices": 0,
            "experts": [],
            "adamw_tensors": 0,
            "adamw_numel": 0,
            "adamw_matrices": [],
            "routers": {"adamw": [], "muon": []},
            "ns_dtype": self._muon.resolved_ns_dtype(),
            "ns_groups": None,
            "ns_batches": None,
        }
        if self._muon.batched:
            batches = self._muon.ns_batches()
            out["ns_groups"], out["ns_batches"] = len(batches), sum(chunks for _, _, chunks in batches)
        experts: set[int] = set()
        index = 0
        for group in self.param_groups:
            names = group.get("param_names", [None] * len(group["params"]))
            part = "muon" if group["use_muon"] else "adamw"
            for name, tensor in zip(names, group["params"]):
                label = name if name is not None else f"#{index}"
                out[f"{part}_tensors"] += 1
                out[f"{part}_numel"] += tensor.numel()
                stack = self._muon.expert_stacks.get(tensor) if group["use_muon"] else None
                role = self._roles.get(tensor)
                if stack is not None:
                    out["muon_expert_stacks"] += 1
                    out["muon_expert_matrices"] += len(stack.shapes(tensor))
                    experts.add(tensor.shape[0])
                elif role == ROUTER:
                    out["routers"][part].append(label)
                elif tensor.ndim > 2 and group["use_muon"]:
                    out["muon_kernels"] += 1
                elif tensor.ndim >= 2 and not group["use_muon"] and role is None:
                    out["adamw_matrices"].append(label)
                index += 1
        out["experts"] = sorted(experts)
        return out

    def describe_routing(self) -> str:
        """One line: how many tensors and parameters each part holds, and which matrices went to AdamW.

        Example: ``Muon 4 tensors (12,288 parameters, 2 conv kernels as matrices; Newton-Schulz in float32,
        batched in 2 groups), AdamW 6 tensors (1,034 parameters); matrices on AdamW: head.weight``. With more
        batches than groups (``ns_batch_bytes``): ``batched in 3 groups, 5 batches``; with ``batched=False``:
        ``matrix by matrix``. Experts: ``(..., 4 expert stacks as 48 matrices (8 experts); ...), AdamW ...;
        routers on AdamW: model.layers.0.mlp.gate.weight, model.layers.1.mlp.gate.weight; matrices on AdamW: ...``.
        """
        r = self.routing()
        experts, routers = describe_experts(r)
        kernels = f"{r['muon_kernels']} conv kernels as matrices" if r["muon_kernels"] else ""
        details = "".join(f", {extra}" for extra in (experts, kernels) if extra)
        precision = ""
        if r["ns_dtype"]:
            if r["ns_groups"] is None:
                how = "matrix by matrix"
            else:
                how = f"batched in {r['ns_groups']} group{'s' * (r['ns_groups'] != 1)}"
                if r["ns_batches"] != r["ns_groups"]:
                    how += f", {r['ns_batches']} batches"
            precision = f"; Newton-Schulz in {r['ns_dtype']}, {how}"
        matrices = ", ".join(r["adamw_matrices"]) or "none"
        return (
            f"Muon {r['muon_tensors']} tensors ({r['muon_numel']:,} parameters{details}{precision}), AdamW"
            f" {r['adamw_tensors']} tensors ({r['adamw_numel']:,} parameters){routers}; matrices on AdamW: {matrices}"
        )

    def _check_disjoint_and_naming(self, group: dict[str, Any]) -> None:
        # Each part checks its own groups; these checks span both parts, as torch does for one optimizer.
        tensors = [p[1] if isinstance(p, tuple) else p for p in group["params"]]
        named = any(isinstance(p, tuple) for p in group["params"])
        seen: set[Tensor] = set()
        for existing in self.param_groups:
            seen.update(existing["params"])
            if ("param_names" in existing) != named and group["params"]:
                raise ValueError(
                    "all optimizer param groups should be with/without names. Pass either only tensors or only"
                    " (name, tensor) pairs, e.g. `model.named_parameters()` everywhere."
                )
        if not seen.isdisjoint(tensors):
            raise ValueError("some parameters appear in more than one parameter group")

    def _share_with_parts(self) -> None:
        # `Optimizer.load_state_dict` and unpickling replace `state` and `param_groups` with new objects;
        # the parts must keep seeing the same ones.
        self._muon.state = self.state
        self._adamw.state = self.state
        self._muon.param_groups = [group for group in self.param_groups if group["use_muon"]]
        self._adamw.param_groups = [group for group in self.param_groups if not group["use_muon"]]

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickled before mixture-of-experts routing existed.
        state.setdefault("expert_patterns", DEFAULT_EXPERT_PATTERNS)
        state.setdefault("muon_routers", False)
        state.setdefault("_roles", {})
        super().__setstate__(state)
        if "_muon" in self.__dict__:
            self._share_with_parts()

    def __getstate__(self) -> dict[str, Any]:
        return {
            **super().__getstate__(),
            "adamw_patterns": self.adamw_patterns,
            "adamw_modules": self.adamw_modules,
            "muon_kernels": self.muon_kernels,
            "expert_patterns": self.expert_patterns,
            "muon_routers": self.muon_routers,
            "_roles": self._roles,
            "_holder": {},
            "_muon": self._muon,
            "_adamw": self._adamw,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` of a ``Muon`` built on the same parameters.

        Raises:
            ValueError: If the saved groups were not routed to Muon and AdamW the same way as this optimizer's.
        """
        saved = [group.get("use_muon") for group in state_dict["param_groups"]]
        current = [group["use_muon"] for group in self.param_groups]
        if saved != current:
            raise ValueError(
                f"The state dict's groups go to Muon/AdamW as {saved} (use_muon per group), this optimizer's as"
                f" {current}. Build the optimizer from the same parameters, names and options as the one that"
                " was saved."
            )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step of both parts.

        Args:
            closure: A callable that re-evaluates the model and returns the loss; called once.

        Returns:
            The closure's return value, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        self._adamw.step()
        return loss
