"""The command lines of the engines (``python -m hvdtrain.spark``, ``python -m hvdtrain.ray``):
the command after ``--``, checked on the driver before anything starts (its program found where
the ranks look for it, ``hvdtrain train``'s options valid), ``KEY=VALUE`` options, and the
settings of an ``hvdtrain train`` command as ``hvdtrain train`` itself reads them. Imports no
engine and no framework.
"""
from __future__ import annotations

import argparse
import os
import shutil

from hvdtrain.launch.ranks import rank_path


def find_command(program: str, env: dict[str, str] | None = None) -> str | None:
    """Where a rank started here with ``env`` (extra variables, as ``--env`` gives them) finds
    ``program``: on the ranks' ``PATH`` (:func:`hvdtrain.launch.ranks.rank_path`: this Python
    environment's ``bin`` first), or as a path (``./train.sh``, relative to the working
    directory); None where it finds nothing it can run. An absolute path is taken as given (it
    may exist on the executors or workers only)."""
    if os.path.isabs(program):
        return program
    return shutil.which(program, path=rank_path(env))


def engine_command(parser: argparse.ArgumentParser, rest: list[str],
                   env: dict[str, str] | None = None) -> list[str]:
    """The command given after ``--`` to an engine's command line. Exits 2 through ``parser``
    when there is none, or when its program is not found where the ranks look for it
    (:func:`find_command`; ``env``: the ranks' extra variables): a typo is the command line's
    fault, so it stops here, before Spark or Ray start, not as a failed or lost rank."""
    command = rest[1:] if rest[:1] == ["--"] else rest
    if not command:
        parser.error("no command: give it after --, e.g. -- hvdtrain train --dataset mnist")
    if find_command(command[0], env) is None:
        parser.error(f"command not found: {command[0]!r} (looked for where the ranks look: "
                     f"{rank_path(env)}); check its spelling, or give its absolute path (not "
                     "checked here: for a program only the executors or workers have)")
    return command


def key_value_pairs(items: list[str], what: str, parser: argparse.ArgumentParser) -> dict:
    """``["K=V", ...]`` (a repeatable option such as ``--env``) as a dict. Exits 2 through
    ``parser``, naming ``what``, for an item without ``=`` or without a key."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def is_train_command(command: list[str]) -> bool:
    """Whether ``command`` is ``hvdtrain train ...``."""
    return len(command) >= 2 and os.path.basename(command[0]) == "hvdtrain" and \
        command[1] == "train"


def with_resume_auto(command: list[str]) -> list[str]:
    """``command`` with ``--resume auto`` added when it is ``hvdtrain train`` without a
    ``--resume``: a run started again (a restarted Ray worker group, a launcher pod the operator
    starts again) continues from the last checkpoint in its output directory."""
    if is_train_command(command) and not any(a == "--resume" or a.startswith("--resume=")
                                             for a in command):
        return [*command, "--resume", "auto"]
    return list(command)


def train_config(command: list[str]):
    """The :class:`hvdtrain.config.TrainConfig` of an ``hvdtrain train ...`` command (argv),
    built from its options as ``hvdtrain train`` parses them: defaults filled in (``output_dir``:
    ``runs/latest``), abbreviations argparse accepts resolved (``--output DIR``), not yet
    validated; None for another command.

    Raises:
        SystemExit: 2, with argparse's message, for options ``hvdtrain train`` refuses.
        hvdtrain.config.ConfigError: options it refuses after parsing (e.g. a bad recipe).
    """
    if not is_train_command(command):
        return None
    from hvdtrain.cli import build_parser
    from hvdtrain.config import TrainConfig
    args = build_parser().parse_args(command[1:])
    return TrainConfig.from_options({k: v for k, v in vars(args).items()
                                     if k not in ("command", "func")})


def engine_refusal(command: list[str], engine: str) -> str | None:
    """Why ``engine`` (``"Spark"``, ``"Ray"``) cannot run ``command``, or None: an ``hvdtrain train
    --elastic`` (or an abbreviation argparse accepts, ``--el`` on) is refused, since the engine
    starts a fixed set of ranks and Horovod Elastic's membership changes need horovodrun's elastic
    driver (``hvdtrain launch --elastic``). Before, such a run trained at a fixed size with
    elastic mode's limits, and a restarted Ray worker group was refused the ``--resume auto``
    the engine adds. Reads the argv only (the options' other checks:
    :func:`check_train_command`)."""
    if not is_train_command(command) or not any(
            len(arg) >= 4 and "--elastic".startswith(arg) for arg in command[2:]):
        return None
    return (f"--elastic: {engine} starts a fixed set of ranks, and Horovod Elastic needs "
            "horovodrun's elastic driver to add and remove workers; drop --elastic here (a run "
            "started again goes on from its last checkpoint with --resume auto), or launch the "
            "job with hvdtrain launch --elastic")


def check_train_command(command: list[str], engine: str | None = None) -> str | None:
    """For ``hvdtrain train ...``: its options' error (as ``hvdtrain train`` would print it),
    checked before an engine starts anything; None when fine or when it is another command.
    ``engine``: the engine that would run it, whose refusal (:func:`engine_refusal`) comes first.

    Raises:
        SystemExit: 2, with argparse's message, for options ``hvdtrain train`` cannot parse (the
            engines' command lines stop there).
    """
    from hvdtrain.config import ConfigError
    refusal = engine_refusal(command, engine) if engine else None
    if refusal:
        return refusal
    try:
        config = train_config(command)
        if config is not None:
            config.validate()
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


def output_dir_of(command: list[str], default: str = "runs/latest") -> str:
    """The directory a command writes: for ``hvdtrain train``, as it reads its options
    (``--output-dir DIR``, ``--output-dir=DIR``, an abbreviation such as ``--output``; its default
    ``runs/latest``: :func:`train_config`); for another program, its last ``--output-dir``;
    else ``default``."""
    if is_train_command(command) and not {"-h", "--help"} & set(command):
        return str(train_config(command).output_dir)
    found = default  # another program: its --output-dir, if it has one
    for i, arg in enumerate(command):
        if arg == "--output-dir" and i + 1 < len(command):
            found = command[i + 1]
        elif arg.startswith("--output-dir="):
            found = arg.split("=", 1)[1]
    return found
