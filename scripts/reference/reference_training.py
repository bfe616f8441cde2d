"""Pieces shared by the training reference scripts (train_reference.py, fsdp2_reference.py):
Modalities' own Python components built from a resolved TOML config, the way Modalities' trainer
uses them on CPU. Not a script; the two scripts import it from their own folder.

  GPT2LLM from the config's model_raw by Modalities' factory; seeded initial weights;
  PackedMemMapDatasetContinuous + ResumableDistributedSampler + GPT2LLMCollateFn;
  CLMCrossEntropyLoss; torch AdamW with Modalities' weight-decay groups; LinearLR warm-up then
  CosineAnnealingLR in a SequentialLR (what `linear_warmup_cosine_annealing_lr` builds); the
  clipper's norm type.
"""
import math
import re
from pathlib import Path

import torch

from modalities.dataloader.dataset_factory import DatasetFactory
from modalities.dataloader.samplers import ResumableDistributedSampler
from modalities.loss_functions import CLMCrossEntropyLoss
from modalities.models.gpt2.collator import GPT2LLMCollateFn
from modalities.models.gpt2.gpt2_model import GPT2LLMConfig
from modalities.models.model_factory import GPT2ModelFactory
from modalities.optimizers.optimizer_factory import _build_optimizer_groups_via_weight_decay_split

INIT_SEED = 1234
INIT_STD = 0.02
# the output projections, initialised with INIT_STD / sqrt(2 * n_layer)
PROJ_PATTERN = r"transformer\.h\.\d+\.attn\.c_proj\.weight|transformer\.h\.\w+\.mlp\.(W_2|c_proj)\.weight"


def build_model(cfg):
    """GPT2LLM from the config's model_raw; returns (model, GPT2LLMConfig)."""
    conf = GPT2LLMConfig(**dict(cfg["model_raw"]["config"]))
    model = GPT2ModelFactory.get_gpt2_model(**{k: getattr(conf, k) for k in type(conf).model_fields})
    return model, conf


def init_weights(model, n_layer, seed=INIT_SEED):
    """Draws the initial weights from one seeded generator in named_parameters() order: output
    projections N(0, 0.02 / sqrt(2 n_layer)), other non-norm weights N(0, 0.02), the rest left as
    built. Returns {name: rule}."""
    g = torch.Generator().manual_seed(seed)
    proj_std = INIT_STD / math.sqrt(2 * n_layer)
    rules = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.fullmatch(PROJ_PATTERN, name):
                p.normal_(0.0, proj_std, generator=g)
                rules[name] = {"rule": "normal", "mean": 0.0, "std": proj_std}
            elif name.endswith(".weight") and "norm" not in name:
                p.normal_(0.0, INIT_STD, generator=g)
                rules[name] = {"rule": "normal", "mean": 0.0, "std": INIT_STD}
            else:
                rules[name] = {"rule": "unchanged"}
    return rules


def full_state_dict(model):
    """Every state_dict key as its own contiguous tensor (safetensors refuses shared storage, e.g.
    the tied lm_head weight)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def build_loader(cfg, sequence_length, micro_batch_size, rank=0, world=1):
    """The config's train dataset, each rank's shuffled share of it (drop_last), in micro-batches."""
    ds_cfg = cfg["train_dataset"]["config"]
    dataset = DatasetFactory.get_packed_mem_map_dataset_continuous(
        raw_data_path=Path(ds_cfg["raw_data_path"]), sequence_length=sequence_length, sample_key=ds_cfg["sample_key"],
        reuse_last_target=ds_cfg.get("reuse_last_target", True))
    smp = cfg["train_dataloader"]["config"]["batch_sampler"]["config"]["sampler"]["config"]
    sampler = ResumableDistributedSampler(dataset, rank=rank, num_replicas=world, shuffle=smp["shuffle"],
                                          seed=smp["seed"], drop_last=True, skip_num_global_samples=0)
    batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size=micro_batch_size, drop_last=True)
    keys = cfg["settings"]["referencing_keys"]
    return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler,
                                       collate_fn=GPT2LLMCollateFn(keys["sample_key"], keys["target_key"]))


def build_loss(cfg):
    keys = cfg["settings"]["referencing_keys"]
    return CLMCrossEntropyLoss(target_key=keys["target_key"], prediction_key=keys["prediction_key"])


def build_optimizer(cfg, model):
    """torch AdamW over Modalities' weight-decay groups of the config's optimizer."""
    o = cfg["optimizer"]["config"]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = _build_optimizer_groups_via_weight_decay_split(o["weight_decay"], o["weight_decay_groups_excluded"],
                                                            model.weight_decay_groups, params)
    return torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], foreach=o.get("foreach"),
                             fused=o.get("fused"))


def build_scheduler(cfg, opt, warmup_steps, total_steps):
    """linear_warmup_cosine_annealing_lr: LinearLR for warmup_steps, then cosine to final_lr."""
    sc = cfg["scheduler"]["config"]
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=sc["initial_lr"] / sc["max_lr"], end_factor=1.0,
                                             total_iters=warmup_steps)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps - warmup_steps, eta_min=sc["final_lr"])
    return torch.optim.lr_scheduler.SequentialLR(opt, schedulers=[warm, cos], milestones=[warmup_steps])


def clip_settings(cfg):
    """(max_norm, norm_type) of the config's gradient clipper."""
    clip = cfg["gradient_clipper"]["config"]
    return clip["max_norm"], {"P1_NORM": 1.0, "P2_NORM": 2.0, "MAX_NORM": math.inf}[clip["norm_type"]]
