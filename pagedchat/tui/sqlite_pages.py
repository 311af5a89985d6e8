"""The rows on a SQLite file's pages, read straight from its bytes: the last resort of the salvage (salvage.py).

When the file is cut short or its interior pages are damaged, SQLite stops at the first page it cannot follow
and every row below it is lost, though the leaf pages that hold the rows are intact. This reads every table
leaf page on its own, as the `sqlite_dbpage` route of SQLite's `.recover` does (the `sqlite3` program's
.recover would do it too, but it is not always installed, and the one in Debian 12 fails on a file with an FTS5
table). Pages on the free list are skipped: they hold deleted rows, which must not come back.

File format: https://www.sqlite.org/fileformat2.html (b-tree pages, cells, overflow chains, records).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

HEADER = 100                 # the database header, before page 1's b-tree header
TABLE_LEAF = 0x0D
DEFAULT_PAGE_SIZE = 4096     # when the header's own figure is unreadable
Value = int | float | str | bytes | None


@dataclass(frozen=True)
class Row:
    rowid: int
    values: tuple[Value, ...]


def varint(data: bytes, at: int) -> tuple[int, int]:
    """SQLite's big-endian varint at `at`: (value, the offset after it)."""
    value = 0
    for i in range(8):
        byte = data[at + i]
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, at + i + 1
    return (value << 8) | data[at + 8], at + 9


class PageFile:
    def __init__(self, data: bytes) -> None:
        self.data = data
        size = struct.unpack(">H", data[16:18])[0] if len(data) >= HEADER else 0
        size = 65536 if size == 1 else size
        self.page_size = size if size >= 512 and size & (size - 1) == 0 else DEFAULT_PAGE_SIZE
        self.usable = self.page_size - (data[20] if len(data) >= HEADER else 0)
        self.count = len(data) // self.page_size

    def page(self, number: int) -> bytes | None:
        if not 1 <= number <= self.count:
            return None
        return self.data[(number - 1) * self.page_size:number * self.page_size]

    def free_pages(self) -> set[int]:
        """The pages on the free list (trunk pages and the leaves they list), as far as it reads."""
        free: set[int] = set()
        trunk = struct.unpack(">I", self.data[32:36])[0] if len(self.data) >= HEADER else 0
        while trunk and trunk not in free and (page := self.page(trunk)) is not None:
            free.add(trunk)
            following, count = struct.unpack(">II", page[:8])
            count = min(count, (self.usable - 8) // 4)
            free.update(struct.unpack(f">{count}I", page[8:8 + 4 * count]))
            trunk = following
        return free

    def leaf_rows(self, number: int) -> list[Row]:
        """The rows of table leaf page `number` that read whole; none if it is not one."""
        page = self.page(number)
        start = HEADER if number == 1 else 0
        if page is None or page[start] != TABLE_LEAF:
            return []
        cells = struct.unpack(">H", page[start + 3:start + 5])[0]
        rows = []
        for i in range(cells):
            try:
                pointer = struct.unpack(">H", page[start + 8 + 2 * i:start + 10 + 2 * i])[0]
                rows.append(self._cell(page, pointer))
            except (IndexError, struct.error, ValueError, UnicodeDecodeError):
                continue   # this cell is damaged: the others on the page still count
        return rows

    def _cell(self, page: bytes, at: int) -> Row:
        size, at = varint(page, at)
        rowid, at = varint(page, at)
        rowid = rowid - (1 << 64) if rowid >= 1 << 63 else rowid
        return Row(rowid, record(self._payload(page, at, size)))

    def _payload(self, page: bytes, at: int, size: int) -> bytes:
        """A cell's payload, following its overflow chain when it does not fit on the page."""
        usable = self.usable
        most = usable - 35
        if size <= most:
            return page[at:at + size]
        least = (usable - 12) * 32 // 255 - 23
        local = least + (size - least) % (usable - 4)
        local = local if local <= most else least
        parts = [page[at:at + local]]
        following = struct.unpack(">I", page[at + local:at + local + 4])[0]
        left, seen = size - local, set()
        while left > 0:
            overflow = self.page(following)
            if overflow is None or following in seen:
                raise ValueError("broken overflow chain")
            seen.add(following)
            parts.append(overflow[4:4 + min(left, usable - 4)])
            left -= usable - 4
            following = struct.unpack(">I", overflow[:4])[0]
        return b"".join(parts)

    def table_rows(self) -> list[Row]:
        """Every row on every table leaf page not on the free list, in page order."""
        free = self.free_pages()
        return [row for n in range(1, self.count + 1) if n not in free for row in self.leaf_rows(n)]


def record(payload: bytes) -> tuple[Value, ...]:
    """A record's values (https://www.sqlite.org/fileformat2.html#record_format); text as UTF-8."""
    header_size, at = varint(payload, 0)
    types = []
    while at < header_size:
        serial, at = varint(payload, at)
        types.append(serial)
    values: list[Value] = []
    body = header_size
    for serial in types:
        if serial == 0:
            values.append(None)
        elif serial in (8, 9):
            values.append(serial - 8)
        elif 1 <= serial <= 6:
            width = (1, 2, 3, 4, 6, 8)[serial - 1]
            values.append(int.from_bytes(payload[body:body + width], "big", signed=True))
            body += width
        elif serial == 7:
            values.append(struct.unpack(">d", payload[body:body + 8])[0])
            body += 8
        elif serial >= 12:
            width = (serial - 12) // 2
            raw = payload[body:body + width]
            if len(raw) != width:
                raise ValueError("record cut short")
            values.append(raw.decode("utf-8") if serial % 2 else raw)
            body += width
        else:
            raise ValueError(f"reserved serial type {serial}")
    if body > len(payload):
        raise ValueError("record cut short")
    return tuple(values)


def read_rows(path: Path) -> list[Row]:
    """Every row that reads on the file's table leaf pages; none if the file cannot be read."""
    try:
        return PageFile(path.read_bytes()).table_rows()
    except OSError:
        return []
