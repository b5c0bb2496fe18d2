"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import AdamW, Optimizer

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    "*embed*",
    "*wte*",
    "*wpe*",
    "*tok.*",
    "*pos.*",
    "*lm_head*",
    "head.*",
    "*.head.*",
)
"""Names (``fnmatch`` patterns on the full dotted parameter name) that go to AdamW although they are 2-D:
token/position embeddings and output heads in the usual naming schemes (nanoGPT, Hugging Face, timm, this
project's demo GPT)."""


def _empty_optimizer(cls: type[Optimizer], **kwargs: Any) -> Optimizer:
    # torch optimizers refuse an empty parameter list but accept an empty group. Dropping that group
    # leaves an optimizer whose groups are exactly the ones `Muon` hands to it, and whose constructor
    # has validated `kwargs` and filled `defaults` with every key its `step` reads.
    optimizer = cls([{"params": []}], **kwargs)
    optimizer.param_groups.clear()
    return optimizer


class Muon(Optimizer):
    r"""Muon on 2-D hidden weight matrices and AdamW on all other parameters, as a single optimizer.

    Muon (`Jordan et al., 2024 <https://kellerjordan.github.io/posts/muon/>`_) replaces each matrix update
    by an orthogonalized Nesterov momentum (Newton-Schulz iteration). It only makes sense for the weight
    matrices of hidden layers; embeddings, the output head, norms and biases are optimized with AdamW. The
    matrix math is :class:`torch.optim.Muon`'s and the rest is :class:`torch.optim.AdamW`'s: this class
    holds one of each, and their ``param_groups`` are the very dicts in :attr:`param_groups`, each tagged with
    ``use_muon``. Learning-rate schedulers, which edit ``param_groups[i]["lr"]``, therefore act on both parts;
    the AdamW groups start from ``adamw_lr``, so a multiplicative schedule scales both parts alike.

    Routing of parameters:

    * plain tensors: 2-D tensors go to Muon, all others to AdamW;
    * ``named_parameters()`` pairs: as above, except that names matching one of ``adamw_patterns``
      (:func:`fnmatch.fnmatchcase` on the full dotted name) go to AdamW;
    * parameter-group dicts: ``"use_muon": True`` / ``False`` decides for the whole group; without that key
      the group is split as above. Other keys of a group (``"lr"``, ``"weight_decay"``, ...) override the
      defaults of whichever part its parameters land in.

    A part may be empty, e.g. on a pipeline stage that holds only the embedding.

    Args:
        params: Tensors, ``(name, tensor)`` pairs (e.g. ``module.named_parameters()``) or parameter-group
            dicts.
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
        adamw_lr: Learning rate of the AdamW part.
        adamw_betas: AdamW's ``(beta1, beta2)``.
        adamw_eps: AdamW's ``eps``.
        adamw_weight_decay: Decoupled weight decay of the AdamW part.
        adamw_patterns: ``fnmatch`` patterns of parameter names that go to AdamW although they are 2-D. Only
            used for named parameters in groups without ``use_muon``.

    Raises:
        ValueError: If a hyperparameter is out of range, if a group with ``"use_muon": True`` contains a
            parameter that is not 2-D, or if the parameter list is empty.

    Example::

        optimizer = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
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
    ) -> None:
        if isinstance(adamw_patterns, str):
            raise TypeError(f"`adamw_patterns` must be a sequence of patterns, got the string {adamw_patterns!r}.")
        self.adamw_patterns = tuple(adamw_patterns)
        self._muon = _empty_optimizer(
            torch.optim.Muon,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self._adamw = _empty_optimizer(
            AdamW, lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        defaults = {
            **self._muon.defaults,
            "adamw_lr": adamw_lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults)
        self._share_with_parts()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, split into a Muon and an AdamW group unless it sets ``use_muon``.

        Args:
            param_group: ``{"params": ..., **options}``. ``"use_muon"`` (``True``/``False``) sends all its
                parameters to one part; without it they are routed by shape and name.

        Raises:
            ValueError: If ``"use_muon"`` is ``True`` and a parameter is not 2-D.
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
        if use_muon is None:
            muon_params = [p for p in params if self._routes_to_muon(p)]
            adamw_params = [p for p in params if not self._routes_to_muon(p)]
        elif use_muon:
            for index, param in enumerate(params):
                name, tensor = param if isinstance(param, tuple) else (None, param)
                if tensor.ndim != 2:
                    label = repr(name) if name is not None else f"at index {index} of its group"
                    raise ValueError(
                        f"Muon only updates 2-D weight matrices, but the parameter {label} has shape"
                        f" {tuple(tensor.shape)} and is in a group with `use_muon=True`. Move it to a group with"
                        " `use_muon=False` (AdamW), or drop `use_muon` from the group to route by shape."
                    )
            muon_params, adamw_params = params, []
        else:
            muon_params, adamw_params = [], params

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

    def _routes_to_muon(self, param: Tensor | tuple[str, Tensor]) -> bool:
        name, tensor = param if isinstance(param, tuple) else (None, param)
        if tensor.ndim != 2:
            return False
        return name is None or not any(fnmatchcase(name, pattern) for pattern in self.adamw_patterns)

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
        super().__setstate__(state)
        if "_muon" in self.__dict__:
            self._share_with_parts()

    def __getstate__(self) -> dict[str, Any]:
        return {
            **super().__getstate__(),
            "adamw_patterns": self.adamw_patterns,
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
