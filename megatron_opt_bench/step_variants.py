"""The implementations bench_step.py trains side by side (docs in megatron_opt_bench.step): the model
they share, megatron_opt, torch DDP + ZeroRedundancyOptimizer and FSDP2, each behind the Variant
interface the runner drives, and the bytes of the state each holds."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

import megatron_opt as mo

from .adamw import MO_STATES, adamw_config, weight_decay_groups
from .fsdp import fully_shard_blocks


# ---------------------------------------------------------------------------------------------- model
class Block(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, hidden: int, layers: int, ffn_mult: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, ffn_mult * hidden) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over features, mean over rows: the grad norm is well above 1, so the
    clipping at 1.0 is active in every step."""
    return (out.float() - target).square().sum(-1).mean()


# ---------------------------------------------------------------------------------------------- memory
def distinct_storage_bytes(tensors) -> int:
    """Sum of the sizes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        seen[(t.device.type, t.device.index, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------- variants
class Variant:
    name: str
    model: torch.nn.Module

    def zero_grad(self) -> None: ...
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def step(self) -> Optional[float]: ...
    def state_tensors(self) -> list[torch.Tensor]: ...
    def full_params(self) -> dict[str, torch.Tensor]: ...  # collective: fp32 masters, full size
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


MO_STATE_LABELS = {"fp32": "", "bf16": " [bf16 m,v]", "bf16+rem": " [bf16 m,v + remainders]"}


class MegatronOpt(Variant):
    def __init__(self, model, args, device, overlap: bool, state: str = "fp32", verify: int = 0) -> None:
        self.name = (("megatron_opt+overlap" if overlap else "megatron_opt") + MO_STATE_LABELS[state]
                     + (f" [verify N={verify}]" if verify else ""))
        self.bf16 = args.dtype == "bf16"
        if self.bf16:
            model.to(torch.bfloat16)
        ddp_cfg = mo.DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap, bucket_size=args.mo_overlap_bucket_size if overlap else None,
        )
        self.ddp = mo.DistributedDataParallel(model, ddp_cfg)
        opt_cfg = adamw_config(args, bf16=self.bf16, verify_interval=verify, **MO_STATES[state])
        self.opt = mo.get_megatron_optimizer(opt_cfg, self.ddp)
        self.model = model
        self.in_dtype = torch.bfloat16 if self.bf16 else torch.float32

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def forward_backward(self, x, y):
        loss = loss_fn(self.ddp(x.to(self.in_dtype)), y)
        loss.backward()
        return loss.detach()

    def step(self):
        success, grad_norm, _ = self.opt.step()
        if not success:
            raise RuntimeError(f"megatron_opt skipped a step ({self.opt.last_skip_reason})")
        return grad_norm

    def state_tensors(self):
        ts = [b.param_data for b in self.ddp.buffers] + [b.grad_data for b in self.ddp.buffers]
        ts += list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        ts += list(self.opt.local_state_tensors().values())  # masters, moments, step counter
        return ts

    def full_params(self):
        """fp32 masters assembled from every rank's shards (a collective; for fp32 they alias the params)."""
        self.ddp.finish_param_sync()
        return self.opt.gather_main_params()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.ddp.finish_param_sync()
        return loss_fn(self.ddp(x.to(self.in_dtype)), y)


class TorchOptimizerVariant(Variant):
    """A torch wrapper with a torch.optim optimizer: clip_grad_norm_ + step, fp32 state tensors."""
    opt: torch.optim.Optimizer
    clip: float

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return norm

    def optimizer_state(self) -> dict:
        """The optimizer's per-param state (ZeRO: its local, owned-shard AdamW's)."""
        return self.opt.state

    def state_tensors(self):
        ts = list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
        for st in self.optimizer_state().values():
            ts += [v for v in st.values() if torch.is_tensor(v)]
        return ts


class DdpZero(TorchOptimizerVariant):
    name = "ddp+zero"

    def __init__(self, model, args, device) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        self.model = model
        self.ddp = TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            gradient_as_bucket_view=True)
        self.opt = ZeroRedundancyOptimizer(
            weight_decay_groups(model.named_parameters(), adamw_config(args)), optimizer_class=torch.optim.AdamW,
            lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, weight_decay=args.weight_decay,
            **adamw_impl_kwargs(args),
        )
        self.clip = args.clip_grad
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                         else contextlib.nullcontext())

    def forward_backward(self, x, y):
        with self.autocast:
            out = self.ddp(x)
        loss = loss_fn(out, y)
        loss.backward()
        return loss.detach()

    def optimizer_state(self):
        return self.opt.optim.state

    def full_params(self):
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def eval_loss(self, x, y):
        with self.autocast:
            out = self.model(x)
        return loss_fn(out, y)


class Fsdp2(TorchOptimizerVariant):
    name = "fsdp2"

    def __init__(self, model, args, device) -> None:
        fully_shard_blocks(model, model.blocks, device.type, bf16=args.dtype == "bf16")
        self.model = model
        self.opt = torch.optim.AdamW(weight_decay_groups(model.named_parameters(), adamw_config(args)), lr=args.lr,
                                     betas=(args.beta1, args.beta2), eps=args.eps,
                                     weight_decay=args.weight_decay, **adamw_impl_kwargs(args))
        self.clip = args.clip_grad

    def forward_backward(self, x, y):
        loss = loss_fn(self.model(x), y)
        loss.backward()
        return loss.detach()

    def full_params(self):
        return {n: p.full_tensor().detach().float().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def eval_loss(self, x, y):
        loss = loss_fn(self.model(x), y)
        self.model.reshard()  # the root stays unsharded after a forward with no backward
        return loss


def adamw_impl_kwargs(args) -> dict:
    if args.torch_adamw == "foreach":
        return {"foreach": True}
    if args.torch_adamw == "fused":
        return {"fused": True}
    return {}
