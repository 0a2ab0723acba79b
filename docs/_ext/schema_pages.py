"""The ``metrics.json`` field tables, written from the dataclasses that declare the schema.

:class:`hvdtrain.run.report.RunHeader` (the run's fields) and
:class:`hvdtrain.run.report.EpochMetrics` (one entry of ``epochs``) are read from the source
(``ast``: nothing is imported), each field with its type and default, and described from
:data:`DESCRIPTIONS` below. A field without a description, or a description of a field that is
gone, is a build warning (an error under ``-W``) that names it: the page cannot drift from the
code.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPORT = Path("hvdtrain/run/report.py")

# What each field means. Units: learning rates per optimizer step, batches in samples, losses in
# nats per sample (mean cross-entropy), accuracies as fractions in [0, 1].
DESCRIPTIONS = {
    "RunHeader": {
        "framework": "`torch` or `keras`.",
        "dataset": "`digits`, `mnist` or `synthetic` (`--dataset`).",
        "size": "Ranks (Horovod's `size`) at the start of the run.",
        "hosts": "Hosts the ranks ran on.",
        "local_batch": "Samples per rank per micro-batch (`--batch-size`).",
        "backward_passes_per_step": "Micro-batches per optimizer step, k "
                                    "(`--backward-passes-per-step`).",
        "global_batch": "Samples per optimizer step over all ranks: local_batch x k x size.",
        "base_lr": "The learning rate given for one process (`--lr`, or the dataset recipe's).",
        "scaled_lr": "The rate after the scaling rule, reached at the end of warmup.",
        "lr_scaling": "The scaling rule: `linear`, `sqrt` or `none` (`--lr-scaling`).",
        "warmup_epochs": "Epochs of gradual warmup from base_lr to scaled_lr.",
        "steps_per_epoch": "Optimizer steps per epoch.",
        "train_samples": "Samples in the training split (all ranks together).",
        "test_samples": "Samples in the test split.",
        "threads_per_rank": "Intra-op threads each rank used.",
        "device": "`cpu` or `cuda` (each rank on its local GPU).",
        "precision": "`fp32`, `bf16` or `fp16` (`--precision`).",
        "horovod_settings": "Horovod's runtime settings in force (cycle time, fusion threshold, "
                            "...) and who chose them; null where none were set.",
        "config": "Every option of the run, as `hvdtrain train` resolved it (`TrainConfig`).",
        "versions": "Versions of the framework (and Keras's backend) and of Horovod.",
        "large_batch_warning": "The warning printed when the global batch is past the range "
                               "where the scaling rule was shown to hold, else null.",
        "elastic": "Whether the run was elastic (`--elastic`); then each epoch also has "
                   "`samples` and `sizes`.",
        "recipe": "The dataset recipe's options the run took (options given on the command "
                  "line win).",
        "resumed_from": "Where a resumed run started: `epoch`, `size`, `global_batch` and "
                        "`batch` of the checkpoint; null for a fresh run.",
        "skipped_steps": "Optimizer steps skipped for a non-finite loss "
                         "(`--on-nonfinite skip`).",
        "overflow_steps": "fp16 only: optimizer steps skipped for overflowing gradients.",
        "ranks_agree": "Whether every rank ended with the same weights (a checksum compared "
                       "across ranks); null until checked.",
        "preempted": "When SIGTERM/SIGUSR1 stopped the run after a checkpoint: `signal`, "
                     "`epoch`, `batch`, `step`, `seconds_to_checkpoint`; else null.",
        "diverged": "Why the divergence check stopped the run, else null.",
        "nonfinite_stop": "Why `--on-nonfinite stop` stopped the run, else null.",
        "engine": "The engine that scheduled the ranks (Spark, Ray: `HVDTRAIN_ENGINE`); null "
                  "under a launcher (horovodrun, mpirun, srun).",
    },
    "EpochMetrics": {
        "epoch": "1-based epoch number.",
        "train_loss": "Mean training loss over the epoch, all ranks.",
        "train_accuracy": "Training accuracy over the epoch, all ranks.",
        "test_loss": "Mean loss on the whole test split after the epoch.",
        "test_accuracy": "Accuracy on the whole test split after the epoch.",
        "lr": "Learning rate at the end of the epoch.",
        "optimizer_steps": "Optimizer steps taken in the epoch (skipped ones not counted).",
        "seconds": "Wall-clock seconds of training in the epoch (evaluation excluded).",
        "samples_per_sec": "Training samples processed by all ranks per second.",
    },
}


class SchemaError(Exception):
    """The schema in the code and DESCRIPTIONS disagree."""


def dataclass_fields(source: str, name: str) -> list[tuple[str, str, str | None]]:
    """``(field, annotation, default or None)`` of class ``name`` in ``source``, in order."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [(st.target.id, ast.unparse(st.annotation),
                     ast.unparse(st.value) if st.value is not None else None)
                    for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]
    raise SchemaError(f"{REPORT}: no class {name}")


def field_table(source: str, name: str) -> tuple[str, list[str]]:
    """The Markdown table of dataclass ``name``'s fields, and the disagreements between
    DESCRIPTIONS and the code (each a message naming the field and what to change)."""
    fields = dataclass_fields(source, name)
    described = DESCRIPTIONS[name]
    problems = [f"{REPORT} {name}.{f} has no description: add it to DESCRIPTIONS in "
                f"docs/_ext/schema_pages.py" for f, _, _ in fields if f not in described]
    problems += [f"docs/_ext/schema_pages.py describes {name}.{f}, which {REPORT} no longer "
                 f"declares: remove it from DESCRIPTIONS"
                 for f in sorted(set(described) - {f for f, _, _ in fields})]
    rows = ["| field | type | meaning |", "|---|---|---|"]
    for field, annotation, default in fields:
        kind = f"`{annotation}`" + (f" (default `{default}`)" if default is not None else "")
        kind = kind.replace("|", "\\|")
        rows.append(f"| `{field}` | {kind} | {described.get(field, '(not described)')} |")
    return "\n".join(rows), problems


def write_pages(root: Path, out_dir: Path) -> list[str]:
    """Write ``run-header.md`` and ``epoch-metrics.md`` (the tables, for ``{include}``); return
    the disagreements between the code and DESCRIPTIONS (the extension reports them as
    warnings, which fail the build)."""
    source = (root / REPORT).read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = []
    for name, file in (("RunHeader", "run-header.md"), ("EpochMetrics", "epoch-metrics.md")):
        text, found = field_table(source, name)
        problems += found
        path = out_dir / file
        if not path.exists() or path.read_text() != text + "\n":
            path.write_text(text + "\n")
    return problems
