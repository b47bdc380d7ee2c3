"""One call from a command line to checked flags: unsupported flags in one error, then the checks."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Mapping, NoReturn, Optional, Sequence

from .flags import add_megatron_args
from .unsupported import NoopValue, unsupported_flags_message
from .validation import MegatronArgumentError, validate_megatron_args


def parse_megatron_args(argv: Optional[Sequence[str]] = None, *, parser: Optional[argparse.ArgumentParser] = None,
                        world_size: Optional[int] = None, unsupported_reasons: Optional[Mapping[str, str]] = None,
                        noop_values: Optional[Mapping[str, NoopValue]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) and validate it (validate_megatron_args).

    ``parser`` is one that add_megatron_args filled (plus the caller's own flags); by default a
    parser with Megatron-LM's flags and defaults. ``world_size`` defaults to torchrun's WORLD_SIZE (1
    without it). Flags the parser does not know are named together in one error, each with its
    reason (UNSUPPORTED_FLAGS', or the caller's ``unsupported_reasons`` for a feature), unless the
    value makes them a no-op (NOOP_VALUES and ``noop_values``: ``--ckpt-format torch_dist``).
    Every error exits with code 2 before anything else runs: ``PROG: error: MESSAGE`` on stderr,
    without argparse's usage text, and printed by rank 0 only (torchrun's RANK; the other ranks exit 2
    silently). The parser keeps this error handler (``parser.error``) for the caller's own checks.
    """
    if parser is None:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_megatron_args(parser)
    parser.error = _usage_error(parser)  # type: ignore[method-assign]  # argparse calls self.error
    args, extras = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    known = [option for action in parser._actions for option in action.option_strings]
    message = unsupported_flags_message(extras, parser.prog, reasons=unsupported_reasons, noop_values=noop_values,
                                        known_flags=known)
    if message:
        parser.error(message)
    try:
        validate_megatron_args(args, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    except MegatronArgumentError as exc:
        parser.error(str(exc))
    return args


def _usage_error(parser: argparse.ArgumentParser) -> Callable[[str], NoReturn]:
    """argparse's error without the usage dump, printed once across torchrun's ranks; exit code 2."""

    def error(message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{parser.prog}: error: {message}\n")
            sys.stderr.flush()
        sys.exit(2)

    return error
