"""The progress bar of the long commands (import, export, verify, the Atari rollout): tqdm on stderr.

Here, among the leaf helpers, so that ``tiered verify`` shows it without importing torch.

Example:
    >>> bar = progress_bar(10, "demo", enabled=False)
    >>> _ = bar.update(10); bar.close()
"""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, unit: str = "rows", enabled: bool | None = True) -> Any:
    """A tqdm bar on stderr (``enabled=None``: only on a terminal; ``False``: none)."""
    from tqdm.auto import tqdm

    disable = None if enabled is None else not enabled
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, disable=disable, leave=False
    )
