"""ElixirStrategy: the Lightning ``Trainer`` running a LightningModule on ElixirModule/ElixirOptimizer.

How it plugs in (Lightning's own extension points):

- ``setup`` plans the LightningModule (``plan=`` / ``search=`` / ``placement_policy=``, see
  :mod:`elixir.search.placement_policy`), wraps it in an :class:`~elixir.wrapper.ElixirModule` and
  the one optimizer from ``configure_optimizers`` in an :class:`~elixir.wrapper.ElixirOptimizer`.
  ``training_step`` and friends reach the LightningModule through the wrapper's ``forward`` by
  Lightning's forward redirection, so elixir's hooks, dtype casts and loss scaling apply.
- Skipped micro-steps of ``accumulate_grad_batches`` run under ``ElixirModule.no_sync()``
  (``block_backward_sync``): no gradient is reduced until the last micro-step.
- ``trainer.save_checkpoint(path)`` writes an elixir sharded checkpoint *directory* (atomic, every
  rank writes its own shards, loadable at another world size); Lightning's own state (loops,
  callbacks, LR schedulers, hyper-parameters) travels inside it. ``fit(ckpt_path=...)`` restores it
  after the wrapping, exactly. A plain single-file Lightning checkpoint also loads (full state on
  every rank).
- Pretrained Hugging Face weights: ``ElixirStrategy(pretrained=dir)`` loads them right after the
  wrapping, or call ``elixir.checkpoint.load_pretrained(dir, self.trainer.strategy.elixir_module)``
  in ``on_fit_start`` (after the wrapping; before ``fit(ckpt_path=...)`` restores, as this strategy
  restores after setup). ``configure_model`` is too early: nothing is wrapped yet.
- ``configure_model()`` runs under ``model_sharded_context``, which builds on the meta device
  (as does ``Trainer.init_module(empty_init=True)``); ``setup`` hands the meta model to
  ``ElixirModule``, which materialises one chunk at a time with the model's own initialisers
  (seeded by ``init_seed``) and keeps only each rank's shards, so no rank holds the whole model.

Unsupported (each raises at setup with the reason): several optimizers, manual optimization,
clipping by value, ``sync_batchnorm``, accelerators other than cpu and gpu, precisions other than
those of :mod:`.precision`.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from elixir import checkpoint as echeckpoint
from elixir import distributed as edist
from elixir.integrations.lightning.precision import ElixirPrecision
from elixir.integrations.options import ElixirOptions
from elixir.search.placement_policy import PlanArg, SearchArg
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.materialize import has_meta_tensors

LIGHTNING_STATE_KEY = "lightning"  # the ``extra`` entry holding Lightning's own checkpoint state


class ElixirStrategy(ParallelStrategy):
    """Train with elixir's chunked ZeRO-3 runtime on one or many nodes (gloo on CPU, NCCL on GPU).

    Args:
        placement_policy: ``"cuda"`` (everything on the compute device), ``"cpu"`` (shards and
            optimizer state in host memory) or ``"auto"`` (``optimal_search`` decides).
        plan: a ready :class:`~elixir.search.SearchResult`, or the path of a plan JSON.
        search: ``"minimum_waste"``, ``"optimal"``, or ``fn(model, world_size, dtype) -> SearchResult``.
        prefetch: gather chunks ahead in the plan's traced order (see ``ElixirModule``).
        offload_dir: directory for chunks the plan puts on disk.
        loss_scale: keyword arguments of ``ElixirOptimizer``'s dynamic loss scale (``initial_scale``,
            ``growth_interval``, ...), used with ``precision="16-mixed"``.
        start_method: ``"popen"`` (re-run the script per rank, as ``strategy="ddp"``), ``"spawn"``
            or ``"fork"``; ignored when a launcher such as torchrun created the processes.
        process_group_backend, timeout: for ``torch.distributed.init_process_group``.
        init_seed: seed of the initialisers of layers built on meta (``configure_model``,
            ``init_module(empty_init=True)``); default: drawn from the global torch RNG, so
            ``seed_everything`` makes it reproducible. See ``ElixirModule``.
        pretrained: a Hugging Face checkpoint directory loaded into the model right after it is
            wrapped (:func:`elixir.checkpoint.load_pretrained`, each rank reading only its rows), for
            every stage; ``fit(ckpt_path=...)`` restores its checkpoint after it, so a resumed run keeps
            its trained weights. The Hugging Face model inside the LightningModule (``self.model``) is
            found by itself; ``pretrained_submodule="model"`` names it.
        verbose: print the plan on rank 0.
        master, moments, frozen: the optimizer-state and frozen-weight formats
            (``MixedPrecisionPolicy``'s fields of these names; docs/optimizer.md), priced by the search.
        allow_lossy_state: let ``optimal_search`` choose leaner state formats where these do not
            fit (``placement_policy="auto"`` or ``search="optimal"``); the run keeps the plan's.
    """

    strategy_name = "elixir"

    def __init__(
        self,
        placement_policy: Literal["cuda", "cpu", "auto"] = "cuda",
        plan: PlanArg = None,
        search: SearchArg = None,
        prefetch: bool = False,
        offload_dir: Optional[str] = None,
        loss_scale: Optional[dict[str, float]] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        init_seed: Optional[int] = None,
        verbose: bool = False,
        pretrained: Optional[str] = None,
        pretrained_submodule: Optional[str] = None,
        master: str = "fp32",
        moments: str = "fp32",
        frozen: Optional[str] = None,
        allow_lossy_state: bool = False,
    ) -> None:
        self.options = ElixirOptions(placement_policy, plan, search, prefetch, offload_dir, loss_scale or {}, verbose,
                                     master, moments, frozen, allow_lossy_state)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.init_seed = init_seed
        self.pretrained, self.pretrained_submodule = pretrained, pretrained_submodule
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.elixir_module: Optional[ElixirModule] = None
        self.elixir_optimizer: Optional[ElixirOptimizer] = None

    # ---- precision: every flag becomes ElixirPrecision ----------------------------------------

    @property
    def precision_plugin(self) -> ElixirPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ElixirPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is None or isinstance(plugin, ElixirPrecision):
            self._precision_plugin = plugin
            return
        # Lightning's generic plugins for the flags (Precision, MixedPrecision, HalfPrecision) carry
        # the flag; anything more specific (bitsandbytes, transformer engine, ...) is not ours to run.
        # optional dependency: lightning
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
            raise TypeError(
                f"strategy='elixir' runs its own precision; the plugin {type(plugin).__name__} is not supported "
                "(pass precision='32-true' | 'bf16-mixed' | '16-mixed' | 'bf16-true' instead)"
            )
        self._precision_plugin = ElixirPrecision(getattr(plugin, "precision", "32-true"))

    # ---- processes and ranks -------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:  # read by Lightning's connector for third-party strategies
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise RuntimeError(
                f"strategy='elixir' runs on accelerator='cpu' (gloo) or 'gpu' (NCCL), not {type(self.accelerator).__name__}"
            )
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            edist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        return edist.broadcast_object(obj, src)

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        # After wrapping the chunks own the parameters' memory; a model on meta is materialised
        # by ElixirModule, straight into its shards.
        assert self.model is not None
        if self.elixir_module is None and not has_meta_tensors(self.model):
            self.model.to(self.root_device)

    # ---- wrapping --------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._check_supported(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        pl_module = self.lightning_module
        if self.elixir_module is not None and self.elixir_module.module is pl_module:
            self.model = self.elixir_module  # a later fit/validate on the same module: already wrapped
        else:
            self.model_to_device()
            prec = self.precision_plugin
            plan = self.options.make_plan(pl_module, self.world_size, prec.dtype, self.is_global_zero)
            self.elixir_module = self.options.wrap(pl_module, plan, prec.dtype, prec.output_fp32, self.init_seed)
            self.elixir_optimizer = None
            self.model = self.elixir_module
            if self.pretrained is not None:  # before Lightning restores fit(ckpt_path=...), which wins
                echeckpoint.load_pretrained(self.pretrained, self.elixir_module, submodule=self.pretrained_submodule)
        if fitting:
            if self.elixir_optimizer is None:
                self.setup_optimizers(trainer)
                if len(self.optimizers) != 1:
                    raise ValueError(
                        f"strategy='elixir' trains with exactly one optimizer, configure_optimizers returned "
                        f"{len(self.optimizers)}; put the parameters in param groups of one optimizer instead"
                    )
                self.elixir_optimizer = self.options.wrap_optimizer(self.elixir_module, self.optimizers[0])
            self.optimizers = [self.elixir_optimizer]
        self.setup_precision_plugin()

    def _check_supported(self, trainer) -> None:
        pl_module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not pl_module.automatic_optimization:
            raise ValueError(
                "strategy='elixir' supports automatic optimization only (manual_backward/opt.step are not "
                "wired to elixir's gradient reduction); set automatic_optimization=True"
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "strategy='elixir' clips gradients by norm only (they live in shards across ranks); "
                "use gradient_clip_algorithm='norm'"
            )
        if self._layer_sync is not None:
            raise ValueError("strategy='elixir' does not support sync_batchnorm=True")

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on meta; ``setup`` materialises into shards (ElixirModule)."""
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model()``: layers are built on meta, so no rank ever holds the whole
        model; ``setup`` materialises them chunk by chunk into each rank's shards."""
        with torch.device("meta"):
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skipped micro-steps of gradient accumulation: no gradient reduction (``no_sync``)."""
        ctx = self.elixir_module.no_sync() if self.elixir_module is not None else nullcontext()
        with ctx:
            yield None

    def _no_inference_mode(self, step: Callable, *args: Any, **kwargs: Any) -> Any:
        # Gathered chunks must not be created as inference tensors (the rCache reuses them in training).
        with torch.inference_mode(False), torch.no_grad():
            return step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_inference_mode(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_inference_mode(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_inference_mode(super().predict_step, *args, **kwargs)

    # ---- checkpoints -----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the chunks, after wrapping

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # elixir's checkpoint restores the optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved sharded by save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}  # saved sharded by save_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy='elixir' writes its own checkpoint directories; storage_options is not supported")
        if self.elixir_module is None:
            raise RuntimeError("nothing to save: the strategy has not wrapped a model yet")
        path = self.broadcast(str(filepath))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        buf = io.BytesIO()
        torch.save(meta, buf)
        blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        with_optimizer = "optimizer_states" in checkpoint and self.elixir_optimizer is not None
        echeckpoint.save(
            path, self.elixir_module, self.elixir_optimizer if with_optimizer else None,
            extra={LIGHTNING_STATE_KEY: blob},
        )

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.elixir_module is not None and self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.elixir_optimizer if fitting else None
        strict = self.lightning_module.strict_loading
        if os.path.isfile(path):  # a single-file Lightning checkpoint (e.g. from strategy="ddp")
            ckpt = torch.load(path, map_location="cpu", weights_only=bool(weights_only))
            self.elixir_module.load_state_dict(ckpt["state_dict"], strict=strict)
            if optimizer is not None and ckpt.get("optimizer_states"):
                optimizer.load_state_dict(ckpt["optimizer_states"][0])
            return ckpt
        extra = echeckpoint.load(path, self.elixir_module, optimizer, strict=strict)
        if not isinstance(extra, dict) or LIGHTNING_STATE_KEY not in extra:
            return {}  # an elixir checkpoint written outside Lightning: weights (and optimizer) only
        blob = extra[LIGHTNING_STATE_KEY].numpy().tobytes()
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=bool(weights_only))

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)  # a directory: removed recursively

    # ---- the end ---------------------------------------------------------------------------------

    def teardown(self) -> None:
        # No ``lightning_module.cpu()`` as other strategies do: the parameters are views into the
        # chunks. Wait for any prefetch still in flight so no collective outlives the run.
        if self.elixir_module is not None:
            self.elixir_module.drain()
        if _distributed_is_initialized():
            edist.drain()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        variants = (
            ("elixir", {}, "elixir chunked ZeRO-3, everything on the compute device"),
            ("elixir_spawn", {"start_method": "spawn"}, "elixir, ranks started with multiprocessing spawn"),
            ("elixir_fork", {"start_method": "fork"}, "elixir, ranks started with fork (notebooks)"),
            ("elixir_cpu_offload", {"placement_policy": "cpu"}, "elixir with shards and optimizer state in host memory"),
            ("elixir_auto", {"placement_policy": "auto"}, "elixir, placement chosen by optimal_search"),
        )
        for name, kwargs, description in variants:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


__all__ = ["ElixirStrategy", "ElixirPrecision"]
