"""Export: one process reads a checkpoint (no process group) and writes a plain model state dict."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed.checkpoint as dcp

from . import directory
from .dcp_errors import dcp_failures
from .dcp_items import ModelSpaceLoadPlanner, saved_tensor_shapes
from .validation import verify_files


def read_tensors(path: Union[str, Path], what: str = "model",
                 iteration: Optional[int] = None) -> dict[str, torch.Tensor]:
    """{param name: full tensor} from a checkpoint, in one process, with no process group.

    ``what``: "model" (the params in their dtype), or an optimizer state name ("master" for the fp32
    master weights, "exp_avg", "exp_avg_sq", ...), reassembled from every rank's part. A state that
    only some params keep (Muon's ``momentum_buffer``, its AdamW companion's moments) comes back for
    those params. A per-matrix state (SOAP's ``L``, ``R``, ``Q_L``, ...) comes back per matrix block, keyed
    ``<param name>@<block offsets>+<block shape>`` (the whole matrix at tensor-parallel size 1: ``@0,0+<shape>``).
    """
    folder = directory.resolve(path, iteration)
    manifest = directory.read_manifest(folder)
    verify_files(folder, manifest)
    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    shapes = saved_tensor_shapes(metadata)
    prefix = "model/" if what == "model" else f"optim/{what}/"
    state: dict[str, torch.Tensor] = {}
    params = manifest["fingerprint"]["params"]
    per_matrix = f"optim/matrix/{what}/"
    if what != "model" and any(k.startswith(per_matrix) for k in shapes):
        # A per-matrix state (SOAP's L, Q_L, ...): one whole tensor per matrix block, '<param>@<offsets>+<shape>'.
        state = {k: torch.empty(shapes[k], dtype=metadata.state_dict_metadata[k].properties.dtype)
                 for k in shapes if k.startswith(per_matrix)}
        prefix = per_matrix
    elif what == "model" or not any(prefix + key in shapes for key, _, _ in params):
        missing = [prefix + key for key, _, _ in params if prefix + key not in shapes]
        if missing:
            raise KeyError(f"{folder} holds no {missing[0]} (saved without an optimizer, or no such state)")
    for key, shape, dtype in (params if prefix != per_matrix else ()):
        if prefix + key not in shapes:
            continue  # a state this param's rule does not keep
        saved_dtype = metadata.state_dict_metadata[prefix + key].properties.dtype
        state[prefix + key] = torch.empty(shape, dtype=saved_dtype)
    with warnings.catch_warnings(), dcp_failures(f"reading {folder}"):
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=ModelSpaceLoadPlanner(), no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def read_model_state(path: Union[str, Path], iteration: Optional[int] = None,
                     masters: bool = False) -> dict[str, torch.Tensor]:
    """{param name: full tensor}: the model params, or with ``masters`` the fp32 master weights."""
    return read_tensors(path, "master" if masters else "model", iteration)


def export(path: Union[str, Path], out: Union[str, Path], iteration: Optional[int] = None,
           masters: bool = False) -> Path:
    """Write the model state dict as ``out`` (.pt via torch.save, .safetensors when that package is
    installed). Returns the written path."""
    state = read_model_state(path, iteration, masters)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise RuntimeError("writing .safetensors needs the safetensors package (pip install safetensors); "
                               "or export to a .pt file") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    else:
        torch.save(state, out)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_opt.checkpoint",
                                description="Consolidate a megatron_opt checkpoint into a plain model state dict.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write CKPT's model as OUT (.pt or .safetensors)")
    e.add_argument("checkpoint", help="the --save folder (uses its tracker) or an iter_* folder")
    e.add_argument("out")
    e.add_argument("--iteration", type=int, default=None)
    e.add_argument("--masters", action="store_true", help="export the fp32 master weights")
    args = p.parse_args(argv)
    written = export(args.checkpoint, args.out, args.iteration, args.masters)
    print(f"wrote {written}")


__all__ = ["read_tensors", "read_model_state", "export", "main"]
