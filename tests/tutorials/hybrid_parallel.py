# ruff: noqa
# ColossalAI's Booster training loop with HybridParallelPlugin (the pattern of its booster_plugins
# docs and its GPT-2 hybrid-parallel example: prepare_dataloader, a criterion(outputs, inputs),
# booster.execute_pipeline on every stage, "loss" read on the last stage), with elixir's imports in
# place of colossalai's. A tiny GPT-2 from a config (no download) on a toy dataset. `rank`,
# `world_size` and `port` are the launcher's; the test defines them.
import torch
from torch.optim import AdamW
from transformers import GPT2Config, GPT2LMHeadModel

import elixir.booster as colossalai
from elixir.booster import Booster
from elixir.booster import HybridParallelPlugin


class ToyDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=128):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(seq)) % vocab  # counting sequences: learnable

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def train():
    colossalai.launch(rank=rank, world_size=world_size, port=port, host='localhost')

    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, num_microbatches=4, precision="fp32", max_norm=1.0)
    booster = Booster(plugin=plugin)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=4, n_head=2))
    optimizer = AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    dataloader = plugin.prepare_dataloader(ToyDataset(), batch_size=8, shuffle=True)

    def _criterion(outputs, inputs):
        return outputs.loss

    model, optimizer, _criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion=_criterion, dataloader=dataloader, lr_scheduler=lr_scheduler
    )
    is_pp_last_stage = plugin.stage_manager.is_last_stage()

    model.train()
    for epoch in range(2):
        dataloader.sampler.set_epoch(epoch)
        train_dataloader_iter = iter(dataloader)
        for step in range(len(dataloader)):
            outputs = booster.execute_pipeline(train_dataloader_iter, model, _criterion, optimizer, return_loss=True)
            if is_pp_last_stage:
                print(f"epoch {epoch} step {step} loss: {outputs['loss'].item():.3f}")
            optimizer.step()
            optimizer.zero_grad()
            lr_scheduler.step()
    print(f"dp_size {plugin.dp_size} lr {optimizer.param_groups[0]['lr']:.6f}")
