"""F1: the keys (as remapped by config.toml), what the inspector shows, and where things are kept."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from pagedchat.text import visible_controls

INSPECTOR_HELP = """\
## The memory inspector (F2)

The model's KV cache lives in fixed-size **pages** (blocks of tokens). Each request has a **block table**
mapping its logical blocks to physical pages, so a chat only takes the pages it fills.

* **Page map** — one cell per page, coloured like the chat's tab marker: `█` in use, `◆` shared by several
  requests (copy-on-write), `░` cached (free to reuse, still holding a finished prefix), `·` free. A large pool
  keeps to a few rows: each cell then stands for several pages (the heading says how many) and shows the
  busiest of them.
* **Block table** — the focused chat: logical block → physical page, how full it is, its reference count.
  `CoW` marks a shared, partly filled page that is copied before either owner writes to it.
* **Sharing and waste** — pages saved by sharing, and what reserving the full context per live request
  (as a contiguous cache would) costs compared with the pages actually used.
* **Prefix hits** — how much of the prompts came from the cache instead of being recomputed.
"""


def keys_markdown(rows: list[tuple[str, str, str]]) -> str:
    """rows: (keys, description, binding id)."""
    lines = ["## Keys", "", "| Keys | Action | Binding id |", "|---|---|---|"]
    for keys, description, binding_id in rows:
        lines.append(f"| `{keys}` | {description} | `{binding_id}` |")
    lines += ["", "Remap any binding in `config.toml` under `[keys]`, e.g. `new_chat = \"ctrl+t\"`.",
              "Every action is also in the command palette (**ctrl+p**)."]
    return "\n".join(lines)


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "close", "Close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str, str]], paths: str) -> None:
        super().__init__()
        # Keys and paths come from the user's config and file system.
        self._text = visible_controls("\n\n".join(["# pagedchat", keys_markdown(rows), INSPECTOR_HELP, paths]))

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog -help"):
            yield Markdown(self._text)

    def action_close(self) -> None:
        self.dismiss(None)
