"""One selector for every op (attention, norms, MLP): `choose(table, ...)` -> `BackendChoice`.

An `OpTable` names an op's backends, its TE_JAX_<OP>_BACKEND variable, the variables that disable a
backend, and the op's automatic and forced policies. `choose` applies the shared precedence
(te_jax/backends/policy.py: argument > environment > auto), records every backend's reason with its
kind (te_jax/backends/base.py), and logs the choice under TE_JAX_DEBUG=1.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from te_jax.backends import policy
from te_jax.backends.base import Reason, ReasonKind, reason


@dataclasses.dataclass
class BackendChoice:
    """Which backend runs a call and, for every backend, why it was or was not taken.

    selected: the backend that runs the call, or None when none can (attention) or a forced one cannot
      (norms/MLP: `error` says why and the op raises ValueError).
    reasons: backend -> None if it serves the call, else a Reason (a str with a `kind`).
    source: "argument", "environment <VAR>=<value>" or "auto".
    """

    selected: str | None
    reasons: dict[str, Reason | None]
    source: str = "auto"
    detail: str = ""  # attention: e.g. which Pallas kernel
    packed: str = ""  # attention, packed-input entry only: read in place or split, and why
    notes: list[str] = dataclasses.field(default_factory=list)
    op: str = "attention"
    requested: str = "auto"
    error: str | None = None
    names: tuple[str, ...] = ()  # the op's backends, in the order the compact form prints them
    style: str = "table"  # "table" (attention) or "compact" (norms, MLP)

    def __str__(self):
        return self._compact() if self.style == "compact" else self._table()

    def _table(self):
        head = (f"{self.op} backend: {self.selected} ({self.source})" if self.selected
                else f"{self.op} backend: none can serve this call ({self.source})")
        if self.detail:
            head += f" — {self.detail}"
        lines = [head]
        for name, why in self.reasons.items():
            mark = "selected" if name == self.selected else ("serves, not chosen" if why is None else "not taken")
            lines.append(f"  {name:7s} {mark}" + (f": {why}" if why else ""))
        if self.packed:
            lines.append(f"  packed input: {self.packed}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _compact(self):
        lines = [f"{self.op}: backend={self.requested!r} -> {self.selected!r}"]
        for b in self.names or tuple(self.reasons):
            r = self.reasons.get(b)
            lines.append(f"  {b}: {'can serve' if r is None else 'cannot serve: ' + r}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What an op's policy hook decides: the backend (or None), notes, and an error for a forced miss."""

    selected: str | None
    notes: tuple[str, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class OpTable:
    """One op's backends and policy.

    auto(ctx, reasons) / forced(ctx, name, source, requested, reasons) -> Decision; both may add
    reasons (e.g. FALLBACK_ALLOWED for a backend that serves but was not chosen).
    disabled_replaces: a disabled backend's reason is only "disabled by ..." (attention), rather than
    appended to why it cannot serve (norms, MLP).
    """

    kind: str
    names: tuple[str, ...]
    force_env: str
    disable_env: Mapping[str, str]
    auto: Callable
    forced: Callable
    disabled_replaces: bool = True
    style: str = "table"


def choose(table: OpTable, requested: str, unsupported: Callable, *, op: str | None = None, ctx=None,
           detail: Callable | None = None) -> BackendChoice:
    """Select a backend for one call of `table`'s op.

    unsupported(name, forced) -> why `name` cannot serve the call (None: it serves); forced: the user
    asked for it. detail(name) -> the explanation's detail line for the selected backend.
    """
    op = op or table.kind
    forced, source = policy.resolve_request(op, requested, table.names, table.force_env)
    reasons: dict[str, Reason | None] = {}
    for name in table.names:
        var = table.disable_env.get(name)
        off = policy.disabled_by_env(var) if var else None
        if off and table.disabled_replaces:
            reasons[name] = Reason(off, ReasonKind.DISABLED)
            continue
        why = reason(unsupported(name, forced == name), ReasonKind.UNSUPPORTED)
        if off:
            why = Reason((why + "; " if why else "") + off, ReasonKind.DISABLED)
        reasons[name] = why
    if forced is None:
        decision = table.auto(ctx, reasons)
    else:
        decision = table.forced(ctx, forced, source, requested, reasons)
    selected = decision.selected
    choice = BackendChoice(selected, reasons, source,
                           detail(selected) if detail is not None and selected is not None else "",
                           notes=list(decision.notes), op=op, requested=requested, error=decision.error,
                           names=table.names, style=table.style)
    policy.log_choice(choice)
    return choice
