"""The three checkpoint paths bench_checkpoint.py times (docs in megatron_opt_bench.checkpoint):
megatron_opt.checkpoint, gather-to-rank-0 + torch.save, FSDP2 + DCP, each behind the Impl interface
(save, async save, load, bytes, reset and compare the load target), and the model they checkpoint."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import megatron_opt as mo
import megatron_opt.checkpoint as ckpt

from .fsdp import fully_shard_blocks


class Net(torch.nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def make_model(args, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(args.hidden, args.layers)


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------------------------- files
def rank_files_bytes(folder: Path, rank: int) -> int:
    """The bytes of a rank's DCP data files (DCP's FileSystemWriter names them __<rank>_<n>.distcp)."""
    return sum(p.stat().st_size for p in folder.glob(f"__{rank}_*.distcp"))


def drop_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the (clean, fsynced) pages of every file under ``folder``."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def clear_dir(root: Path) -> None:
    """Rank 0 empties ``root`` (untimed, between saves); everyone waits."""
    if dist.get_rank() == 0 and root.exists():
        for child in root.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
    dist.barrier()


# ---------------------------------------------------------------------------------------------- implementations
class Impl:
    name: str
    has_async = False

    def save(self, it: int) -> None: ...
    def save_async(self, it: int) -> Callable[[], None]: ...  # returns the wait
    def load(self, it: int) -> None: ...
    def folder(self, it: int) -> Path: ...
    def written_bytes(self, it: int) -> int: ...  # by this rank
    def read_bytes(self) -> int: ...  # the checkpointed state this rank loads into
    def opt_state_bytes(self) -> int: ...  # the optimizer state this rank holds (what it must save)
    def model_bytes(self) -> int: ...  # the whole model's params (or, FSDP2, this rank's shard)
    def reset_target(self) -> None: ...
    def target_matches(self) -> bool: ...


class MegatronModel:
    """A megatron_opt model + optimizer after one training step (shared by two implementations)."""

    def __init__(self, args, seed: int, train: bool) -> None:
        self.bf16 = args.dtype == "bf16"
        model = make_model(args, seed)
        if self.bf16:
            model.to(torch.bfloat16)
        self.model = model
        self.ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True))
        self.opt = mo.get_megatron_optimizer(mo.OptimizerConfig(
            optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=1.0, bf16=self.bf16,
            use_distributed_optimizer=True), self.ddp)
        if train:
            g = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
            x = torch.randn(8, args.hidden, generator=g).to(next(model.parameters()).dtype)
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()
            self.ddp(x).float().square().mean().backward()
            ok, _, _ = self.opt.step()
            assert ok, "the training step was skipped"
            self.ddp.finish_param_sync()

    def state(self) -> list[torch.Tensor]:
        """Model params, then every owned optimizer element (in piece order)."""
        out = [p.detach() for p in self.model.parameters()]
        for ps in self.opt.piece_states():
            out += [ps.tensors[k] for k in sorted(ps.tensors)]
        return out

    def opt_state_bytes(self) -> int:
        return tensor_bytes(t for ps in self.opt.piece_states() for t in ps.tensors.values())

    def model_bytes(self) -> int:
        return tensor_bytes(self.model.parameters())


class MegatronCheckpoint(Impl):
    name = "megatron_opt"
    has_async = True

    def __init__(self, src: MegatronModel, dst: MegatronModel, root: Path) -> None:
        self.src, self.dst, self.root = src, dst, root
        self.checkpointer = ckpt.Checkpointer()

    def folder(self, it):
        return ckpt.resolve(self.root, it)

    def save(self, it):
        self.checkpointer.save(self.root, self.src.ddp, self.src.opt, iteration=it)

    def save_async(self, it):
        self.checkpointer.save(self.root, self.src.ddp, self.src.opt, iteration=it, async_save=True)
        return self.checkpointer.wait_for_pending_save

    def load(self, it):
        self.checkpointer.load(self.root, self.dst.ddp, self.dst.opt, iteration=it)

    def written_bytes(self, it):
        return rank_files_bytes(self.folder(it), dist.get_rank())

    def read_bytes(self):
        return self.src.model_bytes() + self.src.opt_state_bytes()

    def opt_state_bytes(self):
        return self.src.opt_state_bytes()

    def model_bytes(self):
        return self.src.model_bytes()

    def reset_target(self):
        with torch.no_grad():
            for t in self.dst.state():
                t.zero_()

    def target_matches(self):
        return all(torch.equal(a, b) for a, b in zip(self.src.state(), self.dst.state()))


def gather_optimizer_state(opt, rank: int, world: int) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """Every rank's owned optimizer elements, assembled on rank 0 into full per-param fp32 tensors
    ({'master': {name: tensor}, 'exp_avg': ..., 'exp_avg_sq': ...}); None on the other ranks."""
    pieces = opt.piece_states()
    keys = sorted(pieces[0].tensors) if pieces else []
    for ps in pieces:
        for k in keys:
            assert ps.tensors[k].dtype == torch.float32, f"{k} is {ps.tensors[k].dtype}"
    flat = (torch.cat([ps.tensors[k].reshape(-1) for ps in pieces for k in keys]) if pieces
            else torch.empty(0, dtype=torch.float32))
    layout = (keys, [(ps.name, ps.param_start, ps.tensors[keys[0]].numel(), tuple(ps.param.shape)) for ps in pieces])
    if world == 1:
        layouts, bufs = [layout], [flat]
    else:
        layouts = [None] * world if rank == 0 else None
        dist.gather_object(layout, layouts, dst=0)
        n = torch.tensor([flat.numel()], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        n = int(n)
        if flat.numel() < n:
            flat = torch.cat([flat, flat.new_zeros(n - flat.numel())])
        bufs = [torch.empty(n, dtype=torch.float32) for _ in range(world)] if rank == 0 else None
        dist.gather(flat, bufs, dst=0)
    if rank != 0:
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (keys_r, pieces_r), buf in zip(layouts, bufs):
        off = 0
        for name, start, numel, shape in pieces_r:
            for k in keys_r:
                full = out.setdefault(k, {}).get(name)
                if full is None:
                    full = out[k][name] = torch.empty(shape, dtype=torch.float32)
                full.view(-1)[start : start + numel] = buf[off : off + numel]
                off += numel
    return out


class GatherTorchSave(Impl):
    name = "gather+torch.save"

    def __init__(self, src: MegatronModel, dst: MegatronModel, root: Path) -> None:
        self.src, self.dst, self.root = src, dst, root
        self.gather_times: list[float] = []

    def folder(self, it):
        return self.root / f"iter_{it:07d}"

    def file(self, it):
        return self.folder(it) / "checkpoint.pt"

    def save(self, it):
        rank, world = dist.get_rank(), dist.get_world_size()
        t0 = time.perf_counter()
        optim = gather_optimizer_state(self.src.opt, rank, world)
        self.gather_times.append(time.perf_counter() - t0)
        if rank == 0:
            state = {"model": {n: p.detach() for n, p in self.src.model.named_parameters()},
                     "optim": {**optim, "scalars": self.src.opt.scalar_state()}}
            self.folder(it).mkdir(parents=True, exist_ok=True)
            with open(self.file(it), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            del state, optim
        dist.barrier()

    def load(self, it):
        sd = torch.load(self.file(it), map_location="cpu", weights_only=True)
        dst = self.dst
        with torch.no_grad():
            for n, p in dst.model.named_parameters():
                p.copy_(sd["model"][n])
            for ps in dst.opt.piece_states():
                for k, t in ps.tensors.items():
                    t.copy_(sd["optim"][k][ps.name].view(-1)[ps.param_start : ps.param_start + t.numel()])
            dst.opt.load_scalar_state(sd["optim"]["scalars"])
            dst.opt.sync_params_from_masters()
        del sd
        dst.ddp.finish_param_sync()

    def written_bytes(self, it):
        return self.file(it).stat().st_size if dist.get_rank() == 0 else 0

    def read_bytes(self):
        return self.last_file_bytes

    def opt_state_bytes(self):
        return self.src.opt_state_bytes()

    def model_bytes(self):
        return self.src.model_bytes()

    reset_target = MegatronCheckpoint.reset_target
    target_matches = MegatronCheckpoint.target_matches


class Fsdp2Model:
    def __init__(self, args, seed: int, train: bool) -> None:
        model = make_model(args, seed)
        fully_shard_blocks(model, model.layers, "cpu", bf16=args.dtype == "bf16")
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if train:
            g = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
            x = torch.randn(8, args.hidden, generator=g)
            model(x).float().square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def state_dicts(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def state(self) -> list[torch.Tensor]:
        out = [local(p.detach()) for p in self.model.parameters()]
        for p in self.model.parameters():
            st = self.opt.state[p]
            out += [local(st[k]) for k in sorted(st) if torch.is_tensor(st[k])]
        return out


class Fsdp2Dcp(Impl):
    name = "fsdp2+dcp"
    has_async = True

    def __init__(self, src: Fsdp2Model, dst: Fsdp2Model, root: Path) -> None:
        self.src, self.dst, self.root = src, dst, root
        dst.state_dicts()  # initialises the fresh optimizer's state (untimed), as get_state_dict would

    def folder(self, it):
        return self.root / f"iter_{it:07d}"

    def save(self, it):
        dcp.save(self.src.state_dicts(), checkpoint_id=str(self.folder(it)))

    def save_async(self, it):
        fut = dcp.async_save(self.src.state_dicts(), checkpoint_id=str(self.folder(it)))
        return fut.result

    def load(self, it):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.dst.state_dicts()
        dcp.load(state, checkpoint_id=str(self.folder(it)))
        set_state_dict(self.dst.model, self.dst.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def written_bytes(self, it):
        return rank_files_bytes(self.folder(it), dist.get_rank())

    def read_bytes(self):
        return tensor_bytes(self.src.state())

    def opt_state_bytes(self):
        return tensor_bytes(local(v) for st in self.src.opt.state.values() for k, v in st.items()
                            if torch.is_tensor(v) and k != "step")

    def model_bytes(self):
        return tensor_bytes(local(p) for p in self.src.model.parameters())

    def reset_target(self):
        with torch.no_grad():
            for t in self.dst.state():
                if t.is_floating_point():
                    t.zero_()

    def target_matches(self):
        a, b = self.src.state(), self.dst.state()
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
