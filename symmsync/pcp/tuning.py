"""How the direct-KV writer's kernel is launched (:class:`Tuning`): knobs of speed, never of
the bytes written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import int_problem
from ..errors import ConfigError


@dataclass(frozen=True)
class Tuning:
    """How the writer's kernel is launched: knobs of speed, never of the bytes written.

    Args:
        block_rows: rows per work item of the kernel (a power of two, at most 1024).
        num_warps: warps per program (a power of two, at most 32). The kernel's stores
            are 16 bytes per lane when ``block_rows >= 4 * num_warps``.
        spread: give each destination replica its own programs (each quantizes its rows
            itself), so that programs storing to peers and programs storing locally run
            side by side instead of one after the other in every program.
        programs_per_sm: ``n``: a persistent grid of at most ``n`` programs per
            multiprocessor, each taking work items until none are left and loading its
            next item before it stores the current one; ``0``: one program per work item.

    The defaults (4 rows, 1 warp, 8 programs per multiprocessor) were the fastest
    overall of the sweep of benchmarks/pcp_local.py on one H200, from 4k to 32k tokens,
    with the fence fused into the writer's tail (docs/performance.md, "The PCP writer
    on one GPU"): a persistent grid pays the tail's arrival once per program, a grid of
    one program per work item once per item.

    Raises:
        ConfigError: a knob outside its range (the message names it).
    """

    block_rows: int = 4
    num_warps: int = 1
    spread: bool = False
    programs_per_sm: int = 8

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ConfigError(f"Tuning: {problem}")

    def _problem(self) -> str | None:
        """What is wrong with these knobs, or ``None`` (the one check of a tuning)."""
        return (
            int_problem("block_rows", self.block_rows, maximum=1024, power_of_two=True)
            or int_problem("num_warps", self.num_warps, maximum=32, power_of_two=True)
            or int_problem("programs_per_sm", self.programs_per_sm, minimum=0)
        )

    @classmethod
    def with_shorthand(cls, base: object, **shorthand: object) -> tuple[Tuning | None, str | None]:
        """``base`` with the knobs given as shorthand (``None``: keep ``base``'s), and the
        problem that refuses it, if any: what the writer agrees across ranks."""
        if base is None:
            base = cls()
        elif not isinstance(base, cls):
            return None, f"tuning must be a symmsync.pcp.Tuning, got {type(base).__name__}"
        given = {k: v for k, v in shorthand.items() if v is not None}
        if not given:
            return base, None
        try:
            return dataclasses.replace(base, **given), None  # runs __post_init__: the one check
        except ConfigError as e:
            return None, str(e).removeprefix("Tuning: ")
