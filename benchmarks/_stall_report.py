"""The report of ``benchmarks/stall.py``: per-variant summaries, the table, the breakdown, the BENCHMARKS.md section.

One report for both frameworks; what differs (title, reference, columns, breakdown keys, target,
the method text) is one :class:`Report` per framework in :data:`REPORTS`.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from _common import fmt, markdown_table, med, section_head
from _stall import FitResult, Variant


@dataclass
class Summary:
    variant: Variant
    fits: list[FitResult]

    def values(self, attr: str) -> list[float]:
        return [v for fit in self.fits for v in getattr(fit, attr)]

    def part(self, key: str) -> list[float]:
        return [v for fit in self.fits for v in fit.parts.get(key, [])]

    @property
    def blocked(self) -> list[float]:
        return self.values("blocked_s")

    @property
    def first_blocked(self) -> list[float]:
        return [fit.blocked_s[0] for fit in self.fits if fit.blocked_s]

    @property
    def later_blocked(self) -> list[float]:
        return [v for fit in self.fits for v in fit.blocked_s[1:]]

    def step_median(self, attr: str) -> float | None:
        return med([getattr(f, attr) for f in self.fits if getattr(f, attr) is not None])

    def landed_cell(self, ckpts: int) -> str:
        errors = [fit.error for fit in self.fits if fit.error]
        if errors:
            return f"FAILED: {errors[0][:60]}"
        if self.variant.kept != "remote":
            return f"n/a ({self.variant.kept})"
        found = sum(fit.landed.found if fit.landed else 0 for fit in self.fits)
        expected = sum(fit.landed.expected if fit.landed else ckpts for fit in self.fits)
        notes = [fit.landed.note for fit in self.fits if fit.landed and fit.landed.note]
        mark = "ok" if found == expected and not notes else "MISSING"
        return f"{found}/{expected} {mark}" + (f" ({notes[0][:60]})" if notes else "")

    @property
    def flagged(self) -> bool:
        if any(fit.error for fit in self.fits):
            return True
        if self.variant.kept != "remote":
            return False
        return not all(fit.landed is not None and fit.landed.ok for fit in self.fits)


# ------------------------------------------------------------------------------------ columns
@dataclass
class Row:
    """One variant's summary, the reference's and the second reference's (``alt``), for the cells."""

    s: Summary
    ref: Summary | None
    ckpts: int
    alt: Summary | None = None

    def ratio(self, values: Callable[[Summary], float | None], against: str = "ref") -> str:
        other = self.alt if against == "alt" else self.ref
        mine, ref = values(self.s), values(other) if other else None
        return f"{mine / ref:.2f}×" if mine is not None and ref else "–"


def _min(s: Summary) -> float | None:
    return min(s.blocked) if s.blocked else None


def _median(s: Summary) -> float | None:
    return med(s.blocked)


def part_column(key: str, spec: str = ".3f") -> Callable[[Row], str]:
    return lambda r: fmt(med(r.s.part(key)), spec)


COLUMNS: dict[str, Callable[[Row], str]] = {
    "variant": lambda r: r.s.variant.name,
    "landed": lambda r: r.s.landed_cell(r.ckpts),
    "blocked s (median)": lambda r: fmt(_median(r.s)),
    "× ref": lambda r: r.ratio(_median),
    "× alt": lambda r: r.ratio(_median, "alt"),
    "later × ref": lambda r: r.ratio(lambda s: med(s.later_blocked)),
    "min–max s": lambda r: f"{min(r.s.blocked):.3f}–{max(r.s.blocked):.3f}" if r.s.blocked else "–",
    "min × ref": lambda r: r.ratio(_min),
    "first ckpt s": lambda r: fmt(med(r.s.first_blocked)),
    "later ckpts s": lambda r: fmt(med(r.s.later_blocked)),
    "Trainer save s": part_column("Trainer save"),
    "on_save callbacks s": part_column("on_save callbacks"),
    "engine.last_stall_s": part_column("engine.last_stall_s"),
    "to next step s": part_column("to next step"),
    "step excess s": lambda r: fmt(med(r.s.values("step_excess_s"))),
    "others' CPU in hook (cores)": part_column("hook: others' CPU (cores)", ".2f"),
    "quiet step s": lambda r: fmt(r.s.step_median("quiet_step_s")),
    "step during bg work s": lambda r: fmt(r.s.step_median("busy_step_s")),
}


# ------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Report:
    """What one framework's report says: its title, reference variant, columns, breakdown, method text."""

    title: str
    reference: str
    ref_label: str  # the "× ref" columns are headed "× <ref_label>"
    columns: tuple[str, ...]
    breakdown_keys: tuple[str, ...]
    method: Callable[
        [argparse.Namespace, int, int, list[Variant]], list[str]
    ]  # (args, depth, bytes, variants)
    target_ratio: float | None = None  # the spot variant's blocked time ≤ this × the reference's
    floor_text: str = "in-RAM clone of the same state"
    verdict_on_later: bool = False  # the target compares the checkpoints after the first (buffers reused)
    alt_reference: str | None = None  # a second reference, for the "× alt" column
    alt_label: str = ""
    spot: str = "spot"
    versions: tuple[str, ...] = field(default=("torch", "lightning", "fsspec", "s3fs", "moto", "xxhash"))

    @property
    def headers(self) -> list[str]:
        return [
            c.replace(" ref", f" {self.ref_label}").replace(" alt", f" {self.alt_label}")
            for c in self.columns
        ]

    def rows(self, summaries: list[Summary], ckpts: int) -> list[list[str]]:
        by_name = {s.variant.name: s for s in summaries}
        ref, alt = by_name.get(self.reference), by_name.get(self.alt_reference or "")
        return [[COLUMNS[c](Row(s, ref, ckpts, alt)) for c in self.columns] for s in summaries]

    def breakdown_lines(self, summaries: list[Summary]) -> list[str]:
        lines = []
        for s in summaries:
            parts = [f"{key} {fmt(med(s.part(key)))}" for key in self.breakdown_keys if s.part(key)]
            counts: collections.Counter[str] = collections.Counter()
            for fit in s.fits:
                counts.update(fit.counts)
            checkpoints = max(len(s.blocked), 1)
            if counts:
                per = ", ".join(f"{n / checkpoints:g} × {k}" for k, n in counts.most_common())
                parts.append(f"per checkpoint: {per}")
            if parts:
                lines.append(
                    f"- `{s.variant.name}` (medians per checkpoint, s unless noted): " + "; ".join(parts)
                )
        return lines

    def verdict(self, summaries: list[Summary]) -> str | None:
        if self.target_ratio is None:
            return None
        target = f"Target: `{self.spot}` blocked time ≤ {self.target_ratio}× the floor ({self.floor_text})"
        by_name = {s.variant.name: s for s in summaries}
        spot, ref = by_name.get(self.spot), by_name.get(self.reference)
        if spot is None or ref is None or not spot.blocked or not ref.blocked:
            return f"{target}: not measured in this run."
        overall = med(spot.blocked) / med(ref.blocked)
        if self.verdict_on_later and spot.later_blocked and ref.later_blocked:
            ratio = med(spot.later_blocked) / med(ref.later_blocked)
            measured = f"{ratio:.2f}× over the checkpoints after the first; {overall:.2f}× over all"
        else:
            ratio, measured = overall, f"{overall:.2f}×"
        met = "MET" if ratio <= self.target_ratio and not spot.flagged else "NOT MET"
        return f"{target}: **{met}** ({measured})."

    def section(
        self, summaries: list[Summary], args: argparse.Namespace, shape: tuple[int, int], run: dict[str, str]
    ) -> list[str]:
        """The BENCHMARKS.md lines; ``shape`` = (depth, state bytes); ``run`` = versions, command, loadavg."""
        flagged = [s.variant.name for s in summaries if s.flagged]
        lines = [
            *section_head(self.title, run["command"], run["versions"], run["after_command"]),
            *self.method(args, *shape, [s.variant for s in summaries]),
            f"- Load average (1/5/15 min) at start: {run['load_start']}; at end: {run['load_end']}.",
            *([f"- Note: {args.note}"] if args.note else []),
            "",
            *markdown_table(self.headers, self.rows(summaries, args.ckpts)),
            "",
            "Where the time goes:",
            "",
            *self.breakdown_lines(summaries),
            "",
        ]
        if flagged:
            lines += [f"**Flagged (error or checkpoints missing in the bucket): {', '.join(flagged)}**", ""]
        verdict = self.verdict(summaries)
        return lines + ([verdict, ""] if verdict else [])


def _settling(args: argparse.Namespace) -> str:
    return (
        "before them the previous checkpoint's background work is waited for, dirty pages are synced and "
        f"other processes are waited on until they use < {args.quiet_cores:g} cores "
        f"(up to {args.quiet_timeout:g} s; all untimed)."
    )


def lightning_method(args: argparse.Namespace, depth: int, nbytes: int, variants: list[Variant]) -> list[str]:
    return [
        f"- State: {depth} × Linear({args.width}, {args.width}) fp32 + AdamW moments = {nbytes / 1e6:.0f} MB; "
        f"CPU, batch {args.batch}; a checkpoint every {args.every_n} steps, {args.ckpts} per fit, "
        f"{args.rounds} rounds (order reversed on odd rounds) → {args.ckpts * args.rounds} checkpoints per "
        "variant. S3 is moto on loopback.",
        "- Blocked = wall time inside the checkpoint callback's `on_train_batch_end` on checkpoint steps "
        "(hook wrapped on the instance). Each interval ends with two quiet steps and the checkpoint step: "
        + _settling(args)
        + " Step excess = checkpoint step period − median quiet step period. Others' CPU = CPU other "
        "processes used during the hook (/proc/stat, 10 ms ticks: coarse for short hooks), in cores. "
        "Min × floor = best sample / best floor sample (the least disturbed pair). "
        "First ckpt = first of each fit (pays one-off allocations).",
    ]


def hf_method(args: argparse.Namespace, depth: int, nbytes: int, variants: list[Variant]) -> list[str]:
    return [
        f"- State: {depth} × Linear({args.width}, {args.width}) fp32 in a plain `nn.Module` "
        '(`forward(x=None, ...)` returns `{"loss": ...}`) + the Trainer\'s AdamW moments = '
        f"{nbytes / 1e6:.0f} MB; `Trainer(use_cpu=True, report_to=[], dataloader_num_workers=0)`, batch "
        f"{args.batch}; a checkpoint every {args.every_n} steps, {args.ckpts} per fit, {args.rounds} round(s) "
        f"→ {args.ckpts * args.rounds} checkpoints per variant. The Trainer writes `checkpoint-N/` "
        "(model.safetensors + optimizer.pt + scheduler/RNG/trainer state) to a local output_dir. "
        "S3 is moto on loopback.",
        "- Variants: " + "; ".join(f"`{v.name}` = {v.description}" for v in variants) + ".",
        "- Blocked = wall time from the first callback's `on_step_end` on a checkpoint step to the end of "
        "the last callback's `on_save`: the save request, the Trainer's `_save_checkpoint` and every "
        "`on_save` (for `hf-sync`, the upload). Where no `on_save` follows (`hf-floor`'s copy, `hf-spot`'s "
        "RAM snapshot, both taken in `on_step_end`), it ends with the last callback's `on_step_end`, plus, "
        "for `hf-spot`, the snapshot's submission to the writer at the next hook (timed around "
        "`StagedSaves.submit`). "
        "× floor = median / `hf-floor`'s median; later × floor = the same over the checkpoints after the "
        "first of each fit (the floor allocates its buffers, and `hf-spot` its staging, at the first); "
        "× hf-local = median / the Trainer's own local save's median. Trainer save = end of the last `on_step_end` → first "
        "`on_save`; on_save callbacks = first → end of last `on_save`. To next step = first `on_step_end` → "
        "next `on_step_begin` (or `on_train_end`), i.e. blocked + the Trainer's own work after the save. "
        "Step excess = checkpoint step period (`on_step_begin` → next) − median quiet step period. "
        "As in the Lightning section, each interval ends with two quiet steps and the checkpoint step; "
        + _settling(args)
        + " engine.last_stall_s = SpotCheckpointCallback's own measure (save request → its on_save).",
    ]


SETTLE_KEYS = (
    "settle: background",
    "settle: sync",
    "settle: quiet wait",
    "others' load before (cores)",
    "settle: at checkpoint",
)
LEAD_COLUMNS = ("variant", "landed", "blocked s (median)", "× ref", "min–max s")
REPORTS: dict[str, Report] = {
    "lightning": Report(
        title="stall: training-loop time blocked per checkpoint (Lightning, moto S3)",
        reference="floor-clone",
        ref_label="floor",
        columns=(
            *LEAD_COLUMNS,
            "min × ref",
            "first ckpt s",
            "later ckpts s",
            "engine.last_stall_s",
            "step excess s",
            "others' CPU in hook (cores)",
            "quiet step s",
            "step during bg work s",
        ),  # fmt: skip
        breakdown_keys=(
            "hook: process CPU s",
            "hook: minor faults (k)",
            "dump_checkpoint",
            "checkpoint_io.save",
            "engine.save_state",
            "staging.stage",
            "stage: tensor copies",
            "stage: per-tensor walk",
            "stage: copies (finish)",
            "stage: deepcopy of other leaves",
            "staging lock wait",
            "hook − dump − save_state",
            "floor beside",
            "hook ÷ floor beside",
            "extra RSS ÷ state",
            *SETTLE_KEYS,
            "bg write_s",
            "bg upload_s",
        ),  # fmt: skip
        method=lightning_method,
        target_ratio=1.5,
    ),
    "hf": Report(
        title="stall: training-loop time blocked per checkpoint (Hugging Face Trainer, moto S3)",
        reference="hf-floor",
        ref_label="floor",
        alt_reference="hf-local",
        alt_label="hf-local",
        columns=(
            *LEAD_COLUMNS,
            "× alt",
            "first ckpt s",
            "later ckpts s",
            "later × ref",
            "Trainer save s",
            "on_save callbacks s",
            "engine.last_stall_s",
            "to next step s",
            "step excess s",
            "quiet step s",
            "step during bg work s",
        ),  # fmt: skip
        breakdown_keys=(
            "hook: process CPU s",
            "hook: others' CPU (cores)",
            "s3fs put",
            "floor beside",
            "hook ÷ floor beside",
            "extra RSS ÷ state",
            *SETTLE_KEYS,
            "bg upload_s",
        ),  # fmt: skip
        method=hf_method,
        target_ratio=1.5,
        floor_text="`copy_` of the same tensors into preallocated buffers",
        verdict_on_later=True,
        spot="hf-spot",
        versions=("torch", "transformers", "fsspec", "s3fs", "moto", "xxhash"),
    ),
}
