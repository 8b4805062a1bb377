"""CPUAdam: Adam/AdamW on the native fused CPU kernel, a drop-in for ``torch.optim.AdamW``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from elixir.optim import lowbit
from elixir.optim.functional import adam_step_lowbit, adam_step_multi
from elixir.optim.nvme import NvmeOffload, absorb, materialized
from elixir.plan.state_format import check_state_formats, is_lossy

__all__ = ["CPUAdam"]


class CPUAdam(torch.optim.Optimizer):
    """Adam or AdamW whose update runs as one fused SIMD pass per tensor on the CPU.

    ``CPUAdam(params)`` behaves like ``torch.optim.AdamW(params)`` and
    ``CPUAdam(params, adamw_mode=False)`` like ``torch.optim.Adam(params)``: fp32 results are
    bitwise equal to torch's fused kernel except in the last ``numel % 16`` elements of a tensor
    (one-ulp differences there). Parameters must live on the CPU; :class:`HybridAdam` also takes
    accelerator parameters.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps: as in torch's Adam.
        weight_decay: decoupled (AdamW) or L2 (Adam) coefficient; by default 1e-2 in AdamW mode and
            0 in Adam mode, torch's defaults.
        bias_correction: divide the moments by ``1 - beta**step`` (torch always does).
        adamw_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False. Stored in each
            group under torch's key ``decoupled_weight_decay``.
        amsgrad: not implemented; True raises NotImplementedError.
        nvme_offload_fraction: share (in [0, 1]) of the CPU-resident elements, in param-group
            order, whose moments (``exp_avg``, ``exp_avg_sq``) live in a file instead of host
            memory; the step reads them ahead, updates and writes them behind, two buckets of
            ``nvme_offload_bucket_numel`` elements in memory at most (:mod:`elixir.optim.nvme`).
            Results are bitwise those of ``0.0``.
        nvme_offload_dir: directory for that file (created if missing); None: a fresh private
            directory under the system temp dir. The file is unlinked once open, so it goes away
            with the process. A directory that cannot be written or lacks the space raises
            :class:`~elixir.offload.OffloadDirError` here, naming the fix.
        nvme_offload_bucket_numel: elements per staged bucket.
        master, moments: the state formats (:mod:`elixir.optim.lowbit`): ``master="bf16-sr"`` or
            ``"bf16-kahan"`` steps bf16 parameters (the bf16 tensor is the master), ``moments=
            "bf16"`` or ``"int8"`` keeps Adam's moments in that format. Default fp32 for both (the
            bitwise-torch path above). Under an ElixirModule the module's ``MixedPrecisionPolicy``
            sets them (:meth:`set_state_format`).
        seed: seed of the random streams of stochastic rounding (per parameter and step).

    ``state_dict`` is torch's format (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``; torch's
    group keys plus ``bias_correction``), so ``torch.optim.AdamW`` loads it and vice versa.
    Without the native extension the same math runs on torch (one warning).
    """

    _accepts_accelerator = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: Optional[float] = None,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        amsgrad: bool = False,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: Optional[str] = None,
        nvme_offload_bucket_numel: int = 4 << 20,
        *,
        master: str = "fp32",
        moments: str = "fp32",
        seed: int = 0,
    ) -> None:
        if amsgrad:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement AMSGrad; use torch.optim.AdamW(amsgrad=True) "
                "(or torch.optim.Adam) if you need it"
            )
        if weight_decay is None:
            weight_decay = 1e-2 if adamw_mode else 0.0
        if not 0.0 <= float(lr):
            raise ValueError(f"invalid lr {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must lie in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            decoupled_weight_decay=adamw_mode,
            # torch's own keys, so torch's Adam/AdamW can load our state_dict unchanged.
            amsgrad=False,
            maximize=False,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
        )
        super().__init__(params, defaults)
        if not 0.0 <= float(nvme_offload_fraction) <= 1.0:
            raise ValueError(f"nvme_offload_fraction must lie in [0, 1], got {nvme_offload_fraction}")
        self.nvme: Optional[NvmeOffload] = None
        self.state_format = ("fp32", "fp32")
        self.seed = int(seed)
        # id(param) -> (random stream, index of its first element there); others: their position
        self.rng_streams: Dict[int, Tuple[int, int]] = {}
        # id(param) -> the tensor its bf16-kahan ``master_comp`` state starts as (and stays): the
        # compensation its owner keeps beside the master from the initial values on; others: zeros
        self.comp_views: Dict[int, torch.Tensor] = {}
        self.set_state_format(master, moments, nvme_offload_fraction)
        if nvme_offload_fraction > 0:
            self.nvme = NvmeOffload(
                float(nvme_offload_fraction), nvme_offload_dir, _reserve_bytes(self._all_params(), nvme_offload_fraction, nvme_offload_bucket_numel),
                nvme_offload_bucket_numel,
            )

    def set_state_format(self, master: str, moments: str, nvme_offload_fraction: Optional[float] = None) -> None:
        """Keep the state in these formats from now on (state in another format is converted, with
        a warning, at its next step)."""
        check_state_formats(master, moments, where=type(self).__name__)
        fraction = nvme_offload_fraction if nvme_offload_fraction is not None else (0.0 if self.nvme is None else 1.0)
        if is_lossy(master, moments) and fraction > 0:
            raise NotImplementedError(
                f"{type(self).__name__}: nvme_offload_fraction keeps fp32 moments only; with master={master!r}, "
                f"moments={moments!r} put the state on disk through the ElixirModule's plan (optim placement DISK)"
            )
        self.state_format = (master, moments)

    @property
    def lossy(self) -> bool:
        """Whether the state is kept in a format below fp32."""
        return is_lossy(*self.state_format)

    def _all_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> Dict[str, Any]:
        """torch's format; moments offloaded to disk are read back into it one bucket at a time."""
        if self.nvme is None:
            return super().state_dict()
        with materialized(self):
            sd = super().state_dict()
            # torch packs the per-parameter dicts themselves: copy them before the moments leave
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's format; moments of offloaded parameters are moved to the disk one bucket at a time.
        State in another format than this optimizer's is converted at its next step, with a warning."""
        # torch casts all state to the parameter's dtype: low-precision formats keep their own
        # (8-bit codes, bf16 moments, fp32 block scales), put back after the load
        kept = {k: {n: v.detach().clone() for n, v in st.items() if n in lowbit.FORMAT_KEYS and isinstance(v, torch.Tensor)}
                for k, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, self._all_params()):
            for n, v in kept.get(i, {}).items():
                if self.state[p][n].dtype != v.dtype:
                    self.state[p][n] = v.to(p.device)
        if self.nvme is not None:
            absorb(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups loaded from torch's Adam/AdamW lack our keys
            group.setdefault("bias_correction", True)
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step over every parameter that has a ``.grad``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad)
        self.step_params(params, grads)
        return loss

    @torch.no_grad()
    def step_params(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        *,
        div_scale: float = 1.0,
        out_lowps: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> None:
        """Step ``params`` (members of this optimizer's groups) with explicit gradients.

        The fused mixed-precision entry: ``grads`` may be fp16/bf16 for fp32 params, each is
        divided by ``div_scale`` on the fly, and ``out_lowps[i]`` (fp16/bf16, optional) receives
        the updated ``params[i]``. State lives in ``self.state`` as for :meth:`step`.
        """
        if out_lowps is None:
            out_lowps = [None] * len(params)
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        if self.lossy:
            self._step_lowbit(params, grads, out_lowps, group_of, div_scale)
            return
        for p in params:  # state loaded from a low-precision format: converted to fp32 first
            st = self.state.get(p)
            if st and "exp_avg" in st and (st["exp_avg"].dtype != p.dtype or not lowbit.FORMAT_KEYS.isdisjoint(st.keys() - {"exp_avg", "exp_avg_sq"})):
                lowbit.conform_state(st, p.numel(), "fp32", "fp32")
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(p.dtype).view(p.shape)
        # One kernel call per (group, step count): hyperparameters and bias correction are shared.
        buckets: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        nvme = self.nvme
        if nvme is not None:
            nvme.ensure_layout(self._all_params(), self.state)
        disk: Dict[int, int] = {}  # id(param) -> its index in params, for offloaded ones
        for i, p in enumerate(params):
            gi = group_of.get(id(p))
            if gi is None:
                raise ValueError("step_params got a tensor that is not a parameter of this optimizer")
            if p.device.type != "cpu" and not self._accepts_accelerator:
                raise RuntimeError(
                    f"{type(self).__name__} steps CPU parameters only, got one on {p.device}; "
                    "use elixir.optim.HybridAdam for parameters on an accelerator"
                )
            state = self.state[p]
            on_disk = nvme is not None and nvme.is_offloaded(p)
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                if not on_disk:  # an offloaded parameter's moments start as zeros in the file
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if on_disk:  # counted when its last piece is stepped (a failed step leaves it as it was)
                disk[id(p)] = i
            else:
                state["step"] += 1
                buckets[(gi, int(state["step"].item()))].append(i)
        for (gi, step), idx in buckets.items():
            self._run_kernel(
                gi, step,
                [params[i] for i in idx],
                [grads[i] for i in idx],
                [self.state[params[i]]["exp_avg"] for i in idx],
                [self.state[params[i]]["exp_avg_sq"] for i in idx],
                [out_lowps[i] for i in idx],
                div_scale,
            )
        if disk:

            def step_bucket(segments, flats) -> None:
                # pieces of the same (group, step) share one kernel call, as the resident ones do
                calls: Dict[Tuple[int, int], List[Tuple[int, Any]]] = defaultdict(list)
                for s in segments:
                    i = disk[id(s.param)]
                    calls[(group_of[id(s.param)], int(self.state[s.param]["step"].item()) + 1)].append((i, s))
                for (gi, step), items in calls.items():
                    ps, gs, ms, vs, os_ = [], [], [], [], []
                    for i, s in items:
                        ps.append(params[i].view(-1)[s.start : s.end])
                        gs.append(grads[i].reshape(-1)[s.start : s.end])
                        ms.append(flats["exp_avg"][s.offset : s.offset + s.end - s.start])
                        vs.append(flats["exp_avg_sq"][s.offset : s.offset + s.end - s.start])
                        o = out_lowps[i]
                        os_.append(None if o is None else o.view(-1)[s.start : s.end])
                    self._run_kernel(gi, step, ps, gs, ms, vs, os_, div_scale)
                for s in segments:
                    if s.end == s.param.numel():
                        self.state[s.param]["step"] += 1

            nvme.step(set(disk), step_bucket)

    def _step_lowbit(self, params, grads, out_lowps, group_of, div_scale: float) -> None:
        """:meth:`step_params` with low-precision state: one kernel call per (group, step)."""
        master, moments = self.state_format
        position = {id(p): k for k, p in enumerate(self._all_params())}
        buckets: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        for i, p in enumerate(params):
            gi = group_of.get(id(p))
            if gi is None:
                raise ValueError("step_params got a tensor that is not a parameter of this optimizer")
            if p.device.type != "cpu" and not self._accepts_accelerator:
                raise RuntimeError(f"{type(self).__name__} steps CPU parameters only, got one on {p.device}")
            if p.dtype != lowbit.master_dtype(master):
                raise TypeError(
                    f"{type(self).__name__}(master={master!r}) steps {lowbit.master_dtype(master)} parameters, got "
                    f"{p.dtype}: cast the model (model.to(torch.bfloat16) for the bf16 masters) or change the format"
                )
            state = self.state[p]
            if "exp_avg" not in state:
                state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
                new = lowbit.new_state(p.numel(), master, moments, p.device)
                if "master_comp" in new and id(p) in self.comp_views:
                    new["master_comp"] = self.comp_views[id(p)]
                state.update({k: t if k in lowbit.SCALE_KEYS else t.view(p.shape) for k, t in new.items()})
            else:
                lowbit.conform_state(state, p.numel(), master, moments)
            state["step"] += 1
            buckets[(gi, int(state["step"].item()))].append(i)
        for (gi, step), idx in buckets.items():
            group = self.param_groups[gi]
            _check_supported(group, type(self).__name__)
            beta1, beta2 = group["betas"]
            streams = [self.rng_streams.get(id(params[i]), (position.get(id(params[i]), 0), 0)) for i in idx]
            adam_step_lowbit(
                [params[i] for i in idx], [grads[i] for i in idx], [self.state[params[i]] for i in idx],
                master=master, moments=moments, keys=[lowbit.stream_key(self.seed, s, step) for s, _ in streams],
                offsets=[o for _, o in streams], out_lowps=[out_lowps[i] for i in idx], step=step,
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["decoupled_weight_decay"]),
                bias_correction=bool(group["bias_correction"]), div_scale=float(div_scale),
            )

    def _run_kernel(self, gi, step, params, grads, exp_avgs, exp_avg_sqs, out_lowps, div_scale) -> None:
        group = self.param_groups[gi]
        _check_supported(group, type(self).__name__)
        beta1, beta2 = group["betas"]
        adam_step_multi(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group["decoupled_weight_decay"]),
            bias_correction=bool(group["bias_correction"]),
            div_scale=div_scale,
            out_lowps=out_lowps,
        )


def _reserve_bytes(params: Sequence[torch.Tensor], fraction: float, bucket_numel: int) -> int:
    """An upper bound of the file bytes the moments of ``fraction`` of ``params`` take: elements
    rounded up per piece, plus the page alignment of every bucket region."""
    numel = sum(p.numel() for p in params if p.device.type in ("cpu", "meta") and p.is_floating_point())
    elem = max((p.element_size() for p in params if p.is_floating_point()), default=4)
    pieces = len(params) + numel // max(bucket_numel, 1) + 1
    return int(2 * elem * (fraction * numel + 16 * pieces) + 2 * 4096 * pieces)


def _check_supported(group: Dict[str, Any], name: str) -> None:
    """Refuse group options loaded from a torch state_dict that the kernel does not implement."""
    if group.get("amsgrad"):
        raise NotImplementedError(f"{name} does not implement AMSGrad (a loaded param group has amsgrad=True)")
    if group.get("maximize"):
        raise NotImplementedError(f"{name} does not implement maximize=True (found in a loaded param group)")
