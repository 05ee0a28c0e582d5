"""The progress bar of a benchmark: one tick per finished request across every row."""

from __future__ import annotations

from tqdm.auto import tqdm


class Progress:
    """Counts finished requests over all rows; a row that stops early (skipped, failed) still
    moves the bar past its requests, so the bar always ends full."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True)
        self._row_total = 0
        self._row_done = 0

    def start_row(self, label: str, num_requests: int) -> None:
        self._bar.set_description(label)
        self._row_total = num_requests
        self._row_done = 0

    def advance(self, count: int = 1) -> None:
        count = min(count, self._row_total - self._row_done)
        self._row_done += count
        self._bar.update(count)

    def finish_row(self) -> None:
        self.advance(self._row_total - self._row_done)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
