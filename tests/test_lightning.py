"""The Lightning strategy against Lightning's own DDP, in the same processes.

One 2-rank run (gloo) trains a small LightningModule under ``strategy="ddp"`` and ``"elixir"`` in
each precision, with gradient accumulation and clipping, and stops/resumes from an elixir
checkpoint; the assertions compare the results afterwards.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import nullcontext

import pytest
import torch

L = pytest.importorskip("lightning")

from elixir import distributed as edist  # noqa: E402
from elixir.testing import run_distributed  # noqa: E402

STEPS = 5
BATCH = 4  # per rank


class TinyRegressor(L.LightningModule):
    """A 4-layer MLP on a fixed random regression problem; records its losses."""

    def __init__(self, n_samples: int = 8, lr: float = 1e-2, build_in_configure: bool = False) -> None:
        super().__init__()
        self.n_samples = n_samples
        self.lr = lr
        self.losses: list[float] = []
        self.net = None if build_in_configure else self._build()

    @staticmethod
    def _build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
            torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4),
        )

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.n_samples, 16, generator=g)
        y = torch.randn(self.n_samples, 4, generator=g)
        ds = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)


class CountCollectives(L.Callback):
    """elixir's collectives issued per training batch (forward + backward + any step)."""

    def __init__(self) -> None:
        self.per_batch: list[dict] = []
        self._ctx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._ctx = edist.count_collectives()
        self._counter = self._ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._ctx.__exit__(None, None, None)
        self.per_batch.append(dict(self._counter))


WIDE, DEEP = 1024, 16  # WideRegressor: ~67 MB of fp32 parameters, one ~4 MB chunk per layer, so a
# rank's shards (half) plus the chunk being materialised are told apart from the whole model
INIT_SEED = 7


def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


class WideRegressor(TinyRegressor):
    """Built in ``configure_model``; records whether it was built on meta, and the peak rise of
    this process's resident memory from just before ``configure_model`` to just after the strategy
    wrapped the model (``configure_optimizers`` runs then), with the wrapped values at that point."""

    def __init__(self, build_device=None) -> None:
        super().__init__(build_in_configure=True)
        self.build_device = build_device  # None: wherever the strategy builds
        self.built_on_meta = None
        self.peak_rise_bytes = None
        self.initial = None

    @staticmethod
    def _build() -> torch.nn.Module:
        layers = [torch.nn.Linear(16, WIDE)]
        for _ in range(DEEP):
            layers += [torch.nn.Tanh(), torch.nn.Linear(WIDE, WIDE)]
        return torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(WIDE, 4))

    def setup(self, stage: str) -> None:
        # Return freed heap memory to the OS first: otherwise a build can reuse pages that are
        # already resident and the peak would not show it.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak) to the current RSS
        self.rss_before = _rss_kib()

    def configure_model(self) -> None:
        if self.net is None:
            with torch.device(self.build_device) if self.build_device else nullcontext():
                self.net = self._build()
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())

    def configure_optimizers(self):
        self.peak_rise_bytes = (_rss_kib("VmHWM") - self.rss_before) * 1024
        self.initial = self.trainer.strategy.elixir_module.state_dict()
        return super().configure_optimizers()


def _wide_scenario(build_device=None) -> dict:
    from elixir.integrations.lightning import ElixirStrategy

    model = WideRegressor(build_device)
    trainer = _trainer(ElixirStrategy(init_seed=INIT_SEED), max_steps=2)
    trainer.fit(model)
    full = sum(p.numel() * 4 for p in model.parameters())  # fp32
    return {
        "built_on_meta": model.built_on_meta, "peak_rise": model.peak_rise_bytes, "full_bytes": full,
        "initial": model.initial, "losses": model.losses,
    }


def _trainer(strategy, precision="32-true", max_steps=STEPS, callbacks=(), **kw):
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, precision=precision, max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, callbacks=list(callbacks), **kw,
    )


def _params(trainer) -> dict[str, torch.Tensor]:
    strategy = trainer.strategy
    if getattr(strategy, "elixir_module", None) is not None:
        return strategy.elixir_module.state_dict()
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


def _fit(strategy, precision="32-true", module_kw=None, **kw):
    model = TinyRegressor(**(module_kw or {}))
    trainer = _trainer(strategy, precision, **kw)
    trainer.fit(model)
    return model.losses, _params(trainer), trainer


def _scenarios(tmp: str) -> dict:
    import elixir.integrations.lightning  # noqa: F401  (registers "elixir")

    out = {}
    out["ddp"] = _fit("ddp")[:2]
    losses, params, trainer = _fit("elixir")
    out["elixir"] = (losses, params)
    out["elixir_is_sharded"] = trainer.strategy.elixir_module.world_size == 2
    for p in ("bf16-mixed", "16-mixed"):
        losses, params, trainer = _fit("elixir", p)
        out[p] = (losses, params, trainer.strategy.elixir_module.dtype)
    acc = dict(accumulate_grad_batches=2, gradient_clip_val=0.05, module_kw={"n_samples": 16})
    out["ddp_acc"] = _fit("ddp", **acc)[:2]
    counter = CountCollectives()
    out["elixir_acc"] = _fit("elixir", callbacks=[counter], **acc)[:2]
    out["acc_counts"] = counter.per_batch

    # stop after 3 steps, save, resume in a new Trainer to 5
    ckpt = os.path.join(tmp, "step3.ckpt")
    model = TinyRegressor()
    trainer = _trainer("elixir", max_steps=3)
    trainer.fit(model)
    trainer.save_checkpoint(ckpt)
    first = list(model.losses)
    model = TinyRegressor()
    trainer = _trainer("elixir", max_steps=STEPS)
    trainer.fit(model, ckpt_path=ckpt)
    out["resumed"] = (first + model.losses, _params(trainer), trainer.global_step)
    out["ckpt_is_dir"] = os.path.isdir(ckpt)

    # configure_model: layers built on meta and materialised into shards; the control builds the
    # same model on the CPU inside the hook (the strategy's meta context overridden)
    out["meta"] = _wide_scenario()
    out["eager"] = _wide_scenario("cpu")
    out["manual_refused"] = _refused()

    # ModelCheckpoint writes checkpoint directories and removes the older ones (save_top_k=1)
    mc_dir = os.path.join(tmp, "mc")
    mc = L.pytorch.callbacks.ModelCheckpoint(dirpath=mc_dir, every_n_train_steps=2, save_top_k=1)
    trainer = L.Trainer(strategy="elixir", accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[mc])
    trainer.fit(TinyRegressor())
    trainer.strategy.barrier()
    out["model_checkpoint"] = (sorted(os.listdir(mc_dir)), mc.best_model_path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lightning"))
    return run_distributed(_scenarios, 2, tmp, timeout=600)


def _close(a, b, rtol=1e-5, atol=1e-7):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.dist
def test_fp32_equals_ddp(results):
    for rank_out in results:
        ddp_losses, ddp_params = rank_out["ddp"]
        losses, params = rank_out["elixir"]
        assert len(losses) == STEPS and rank_out["elixir_is_sharded"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0)
        _close(params, ddp_params)


@pytest.mark.dist
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_trains(results, precision, dtype):
    for rank_out in results:
        losses, params, chunk_dtype = rank_out[precision]
        ref_losses, _ = rank_out["ddp"]
        assert chunk_dtype == dtype  # 16-mixed really runs fp16 on CPU (Lightning alone would switch to bf16)
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
        # low precision tracks fp32 closely on this tiny problem, and the loss falls as in fp32
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=5e-2, atol=5e-3)
        assert losses[-1] < losses[0]


@pytest.mark.dist
def test_accumulation_and_clipping_equal_ddp(results):
    for rank_out in results:
        ddp_losses, ddp_params = rank_out["ddp_acc"]
        losses, params = rank_out["elixir_acc"]
        assert len(losses) == 2 * STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0)
        _close(params, ddp_params)
        # skipped micro-steps (even batch index) reduce no gradient; the last one of each step does
        counts = rank_out["acc_counts"]
        for i, c in enumerate(counts):
            reductions = c.get("reduce_scatter", 0) + c.get("all_reduce", 0)
            if i % 2 == 0:
                assert reductions == 0, (i, c)
            else:
                assert reductions > 0, (i, c)


@pytest.mark.dist
def test_resume_is_bitwise(results):
    for rank_out in results:
        losses, params, global_step = rank_out["resumed"]
        ref_losses, ref_params = rank_out["elixir"]
        assert rank_out["ckpt_is_dir"] and global_step == STEPS
        assert losses == ref_losses
        for k in ref_params:
            assert torch.equal(params[k], ref_params[k]), k


@pytest.mark.dist
def test_model_checkpoint_callback(results):
    names, best = results[0]["model_checkpoint"]
    assert names == ["epoch=3-step=4.ckpt"], names  # one step per epoch; step 2's directory was removed
    assert os.path.isdir(best) and os.path.isfile(os.path.join(best, "index.json"))


@pytest.mark.dist
def test_configure_model_builds_on_meta_and_no_rank_holds_the_full_model(results):
    from elixir.wrapper.materialize import materialize

    twin = torch.nn.Module()
    with torch.device("meta"):
        twin.net = WideRegressor._build()
    reference = materialize(twin, INIT_SEED).state_dict()  # plain torch, the values ElixirModule gives
    for rank_out in results:
        meta, eager = rank_out["meta"], rank_out["eager"]
        assert meta["built_on_meta"] and eager["built_on_meta"] is False
        full = meta["full_bytes"]
        # the measure sees a full model when one is built (the control), and none with meta: each
        # rank's construction peak stays below the whole model (its shard is half of it)
        assert eager["peak_rise"] >= full, (eager["peak_rise"], full)
        assert meta["peak_rise"] < full, (meta["peak_rise"], full)
        _close(meta["initial"], reference, rtol=0, atol=0)
        assert len(meta["losses"]) == 2 and all(torch.isfinite(torch.tensor(meta["losses"])))


def test_registered_and_unsupported_options():
    from elixir.integrations.lightning import ElixirStrategy

    names = L.pytorch.strategies.StrategyRegistry.available_strategies()
    for name in ("elixir", "elixir_spawn", "elixir_cpu_offload", "elixir_auto"):
        assert name in names
    with pytest.raises(ValueError, match="placement_policy"):
        ElixirStrategy(placement_policy="gpu-only")
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(strategy="elixir", accelerator="cpu", devices=1, precision="64-true")


class ManualOptimization(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _refused() -> str:
    try:
        _trainer("elixir", max_steps=1).fit(ManualOptimization())
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_manual_optimization_refused_on_every_rank(results):
    msgs = [r["manual_refused"] for r in results]
    assert all("automatic optimization only" in m for m in msgs), msgs
