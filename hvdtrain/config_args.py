"""How :class:`~hvdtrain.config.TrainConfig`'s options appear on the command line: ``hvdtrain
train --help``'s groups, value names, and each dataset recipe's values
(:data:`hvdtrain.datasets.recipes.RECIPES`) beside the options it sets. The options themselves,
their defaults and checks are declared once, in :mod:`hvdtrain.config`.
"""
from __future__ import annotations

import argparse
import textwrap

from hvdtrain.config import TrainConfig, cli_fields, flag_of


# ``hvdtrain train --help``'s sections: title -> (description, the fields in it, in this order).
OPTION_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "data": ("The dataset, and the recipe it brings.",
             ("dataset", "data_dir", "test_fraction", "synthetic_samples")),
    "model and optimizer": (
        "Global batch = --batch-size x --backward-passes-per-step x ranks; --lr is the rate of "
        "one process, scaled with the global batch by --lr-scaling.",
        ("framework", "keras_backend", "epochs", "batch_size", "lr", "momentum", "dropout",
         "lr_scaling", "warmup_epochs", "lr_schedule", "lr_min_ratio", "lr_steps", "batchnorm",
         "seed", "divergence_check")),
    "distribution": ("How the ranks share the work (Horovod's all-reduce).",
                     ("backward_passes_per_step", "compression", "op", "device")),
    "precision": (None, ("precision", "init_loss_scale", "on_nonfinite")),
    "checkpoints": ("Rank 0 writes a checkpoint into --output-dir after every epoch, and "
                    "mid-epoch when SIGTERM or SIGUSR1 stops the run.", ("resume", "requeue")),
    "output": (None, ("output_dir", "progress", "tensorboard", "log_every")),
    "launch": ("Start the ranks with horovodrun, mpirun, srun or hvdtrain launch; these "
               "options are for Horovod Elastic (hvdtrain launch --elastic).",
               ("elastic", "commit_every")),
}


# Short value names for --help (argparse's default is the field's name in capitals).
METAVARS = {"epochs": "N", "batch_size": "N", "backward_passes_per_step": "K",
            "warmup_epochs": "EPOCHS", "lr_min_ratio": "RATIO", "output_dir": "DIR",
            "test_fraction": "FRACTION", "synthetic_samples": "N", "commit_every": "N",
            "init_loss_scale": "SCALE", "data_dir": "PATH", "log_every": "N", "seed": "N"}


def _recipes_setting(name: str) -> str:
    """``"; --dataset mnist: 4"`` for each dataset whose recipe sets field ``name``."""
    from hvdtrain.datasets.recipes import RECIPES
    return "".join(f"; --dataset {dataset}: {_shown(recipe[name])}"
                   for dataset, recipe in RECIPES.items() if name in recipe)


def _shown(value) -> str:
    """A value as typed on the command line (``0.01``, ``cosine``; booleans: on/off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _dataset_help(f) -> str:
    """``--dataset``'s help: the datasets, then what each one's recipe sets."""
    from hvdtrain.datasets.recipes import RECIPES
    plain = [d for d in f.metadata["choices"] if not RECIPES.get(d)]
    own = "; ".join(
        f"{d}: " + " ".join(f"{flag_of(TrainConfig.__dataclass_fields__[k])} {_shown(v)}"
                            for k, v in RECIPES[d].items())
        for d in f.metadata["choices"] if RECIPES.get(d))
    return (f"{f.metadata['help']}. A dataset's recipe sets the options left out of the "
            f"command line: {own}; {' and '.join(plain)}: none (metrics.json's recipe says "
            "which a run took)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every :class:`TrainConfig` option on ``parser``, in the argument groups of
    :data:`OPTION_GROUPS` (hidden options on ``parser`` itself, without help), with its help,
    its allowed values as the metavar (``{torch,keras}``: :meth:`TrainConfig.validate` checks
    them, with a message naming the option) and its default as declared (:func:`option`),
    followed by what each dataset's recipe (:data:`hvdtrain.datasets.recipes.RECIPES`) sets it
    to. An option left out of the command line is left out of the parsed namespace
    (``argparse.SUPPRESS``), so :meth:`TrainConfig.from_options` knows what was given.

    Raises:
        ValueError: a command-line field is in no group of :data:`OPTION_GROUPS`, or in two.
    """
    by_name = {f.name: f for f in cli_fields()}
    placed = [n for _, names in OPTION_GROUPS.values() for n in names]
    visible = [n for n, f in by_name.items() if not f.metadata["hidden"]]
    if sorted(placed) != sorted(visible):
        raise ValueError(f"OPTION_GROUPS must hold each visible option once: {sorted(placed)} "
                         f"vs {sorted(visible)}")
    for title, (description, names) in OPTION_GROUPS.items():
        group = parser.add_argument_group(
            title, description and textwrap.fill(description, 78))
        for name in names:
            _add(group, by_name[name])
    for f in by_name.values():
        if f.metadata["hidden"]:
            _add(parser, f)


def _add(parser, f) -> None:
    """Declare option field ``f`` on ``parser`` (a parser or an argument group)."""
    meta = f.metadata
    flags = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
    extra = dict(meta["argparse"])
    action = extra.get("action")
    if action is None and f.type in ("int", "float"):
        extra["type"] = int if f.type == "int" else float
    if meta["choices"]:
        choices = tuple(c for c in meta["choices"] if c)  # "" (off) is not typed
        if extra.get("nargs") == "?":
            extra["choices"] = choices
        else:
            extra.setdefault("metavar", "{" + ",".join(choices) + "}")
    if f.name in METAVARS and not action:
        extra.setdefault("metavar", METAVARS[f.name])
    if meta["hidden"]:
        text = argparse.SUPPRESS
    else:
        text = _dataset_help(f) if f.name == "dataset" else meta["help"]
        if action in ("store_true", "store_false"):
            shown = ""
        elif action is argparse.BooleanOptionalAction:
            shown = f"default: {_shown(f.default)}"
        else:
            shown = "" if f.default in ("", None) else f"default: {_shown(f.default)}"
        shown += _recipes_setting(f.name)
        if shown:
            text += f" ({shown.lstrip('; ')})"
    parser.add_argument(*flags, dest=f.name, default=argparse.SUPPRESS, help=text, **extra)
