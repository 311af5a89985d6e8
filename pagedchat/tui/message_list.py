"""A chat's messages on screen: only a window of them is mounted, so a chat of any length opens at once.

The record keeps every message (ChatRecord.messages: cheap, plain text); what is costly is a mounted view,
which renders its Markdown into widgets. The list mounts the views of messages[start:end] only: the newest
page (about a screen and a half, by an estimate of each message's rows) at open, a page more when the user
scrolls to an edge (older at the top; newer at the bottom, after a jump to an old message or a long scroll
up), and about KEPT_PAGES pages at most, letting the far edge's views go. A page added at the top keeps what
the user was reading where it was on screen.

Every change to the window runs on the app's message loop, as every other change to a chat does (chat_view.py),
so a page loaded on scroll never interleaves with a reply's updates or a key's action.
"""

from __future__ import annotations

from typing import Callable

from textual import events
from textual.containers import VerticalScroll
from textual.widget import Widget

from pagedchat.tui.chat_widgets import MessageView, laid_out_size
from pagedchat.tui.conversation import ChatMessage

PAGE_SCREENS = 1.5     # a page of messages, mounted at once, is about this many screens of rows
KEPT_PAGES = 2         # mounted at most, about: past it the views at the far edge go
MIN_WIDTH = 20         # the width rows are estimated at, however narrow the terminal
FRAME_ROWS = 3         # a message's rows besides its text: the gap above it, its role and its stats line


def message_rows(message: ChatMessage, width: int) -> int:
    """About how many rows a message takes `width` columns wide (Markdown may take a few more or fewer)."""
    return FRAME_ROWS + sum(len(line) // width + 1 for line in message.content.split("\n"))


def _page_length(messages: list[ChatMessage], first: int, step: int, rows: int, width: int) -> int:
    """How many messages, from `first` on going by `step` (-1 older, +1 newer), fill `rows` rows; at least one."""
    taken = filled = 0
    index = first
    while 0 <= index < len(messages) and (taken == 0 or filled < rows):
        filled += message_rows(messages[index], width)
        taken += 1
        index += step
    return taken


def older_page(messages: list[ChatMessage], end: int, rows: int, width: int) -> int:
    """Where the page of messages just before `end` starts."""
    return end - _page_length(messages, end - 1, -1, rows, width)


def newer_page(messages: list[ChatMessage], start: int, rows: int, width: int) -> int:
    """Where the page of messages from `start` on ends (exclusive)."""
    return start + _page_length(messages, start, 1, rows, width)


class MessageList(VerticalScroll):
    """The chat's log: the views of messages[start:end], in order, each knowing its index."""

    virtual_size = laid_out_size()   # its scrollbars and its anchor at the end are set by the layout

    def __init__(self, messages: Callable[[], list[ChatMessage]],
                 make_view: Callable[[ChatMessage, int], MessageView],
                 release_focus: Callable[[], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self._messages = messages            # the record's list, read afresh: it changes as the chat does
        self._make_view = make_view
        self._release_focus = release_focus  # a focused view is about to go: focus goes here instead
        self.start = self.end = 0
        self._changing = False               # a window change waits for its layout; no other is started
        self._held: tuple[MessageView, float] | None = None   # a view kept where it was on screen

    @property
    def views(self) -> list[MessageView]:
        # Its children looked at, not queried: view_at runs at each batch of a reply's updates.
        return [child for child in self.children if isinstance(child, MessageView)]

    @staticmethod
    def child_of(parent: Widget) -> MessageList | None:
        """parent's MessageList (None before it is composed, and while it closes), looked for among its children:
        called at each batch of a reply's updates, where a query would match selectors on every message's widgets."""
        return next((child for child in parent.children if isinstance(child, MessageList)), None)

    def view_at(self, index: int | None) -> MessageView | None:
        """Message `index`'s view while it is among the list's children: a page being mounted is there before
        `start` and `end` take it in, and a reply's update or end meanwhile is for its view all the same."""
        return next((v for v in self.views if v.index == index), None) if index is not None else None

    def _older_page(self, end: int, pages: float = 1) -> int:
        return older_page(self._messages(), end, *self._page_size(pages))

    def _newer_page(self, start: int, pages: float = 1) -> int:
        return newer_page(self._messages(), start, *self._page_size(pages))

    def _page_size(self, pages: float) -> tuple[int, int]:
        """`pages` pages' rows, and the width their text wraps at, from the terminal's size."""
        size = self.app.size
        return int(size.height * PAGE_SCREENS * pages), max(size.width, MIN_WIDTH)

    # ---- what the chat asks for ----------------------------------------------------------------------------
    async def show_last(self, upto: int | None = None) -> None:
        """The newest page (of the messages before `upto`, if given), scrolled to its end."""
        end = len(self._messages()) if upto is None else upto
        await self._replace(self._older_page(end), end)
        self.scroll_end(animate=False, immediate=True)

    async def reveal(self, index: int) -> MessageView | None:
        """Message `index`'s view, mounting it first (with a page around it) if it is not."""
        if not 0 <= index < len(self._messages()):
            return None
        if index == self.start - 1:
            await self.older()
        elif index == self.end:
            await self.newer()
        elif not self.start <= index < self.end:
            await self._replace(self._older_page(index, 0.5), self._newer_page(index))
        return self.view_at(index)

    async def append(self, message: ChatMessage, index: int) -> MessageView:
        """Mount the view of `message`, the new last one at `index` (the window moves to the end first if it
        is elsewhere, or was emptied by a cut)."""
        if self.end != index or self.start == self.end:
            await self.show_last(upto=index)
        await self._keep(max(self.start, self._older_page(index + 1, KEPT_PAGES)), index)
        view = self._make_view(message, index)
        await self.mount(view)
        self.end = index + 1
        return view

    async def cut(self, count: int) -> None:
        """Unmount the views of messages from index `count` on (they left the record)."""
        await self._keep(min(self.start, count), min(self.end, count))

    async def older(self) -> bool:
        """A page of older messages above the first, keeping that one where it is on screen. False if none."""
        if self.start == 0:
            return False
        start = self._older_page(self.start)
        first = self.views[0] if self.views else None
        self._hold(first)
        # The far edge's views go first, so that no more than KEPT_PAGES are ever mounted.
        await self._keep(self.start, min(self.end, self._newer_page(start, KEPT_PAGES)))
        await self.mount_all(self._build(start, self.start), before=first)
        self.start = start
        self._settle_after_refresh()
        return True

    async def newer(self) -> bool:
        """A page of newer messages below the last, keeping that one where it is on screen. False if none."""
        if self.end >= len(self._messages()):
            return False
        end = self._newer_page(self.end)
        views = self.views
        self._hold(views[-1] if views else None)
        await self._keep(max(self.start, self._older_page(end, KEPT_PAGES)), self.end)
        await self.mount_all(self._build(self.end, end))
        self.end = end
        self._settle_after_refresh()
        return True

    # ---- the window's changes -------------------------------------------------------------------------------
    def _build(self, start: int, end: int) -> list[MessageView]:
        messages = self._messages()
        return [self._make_view(messages[i], i) for i in range(start, end)]

    async def _replace(self, start: int, end: int) -> None:
        self._changing = True
        await self._keep(start, start)
        if end > start:
            await self.mount_all(self._build(start, end))
        self.end = end
        self._settle_after_refresh()

    async def _keep(self, start: int, end: int) -> None:
        """Unmount every view outside [start, end), which is then the window."""
        doomed = [v for v in self.views if not start <= v.index < end]
        if self.app.focused in doomed:
            # Else Textual hands focus to a neighbouring message, and the walk's one-letter keys would act on a
            # message the user never chose (typing "e" would open the edit dialog).
            self._release_focus()
        if doomed:
            await self.remove_children(doomed)
        self.start, self.end = start, end

    def _hold(self, view: MessageView | None) -> None:
        """Keep `view` at its place on screen through the change that follows (the first such, if several)."""
        self._changing = True
        if self._held is None and view is not None:
            self._held = (view, view.virtual_region.y - self.scroll_y)

    def _settle_after_refresh(self) -> None:
        # Only after the new views are laid out do their heights, and so the place to scroll back to, exist.
        self.call_after_refresh(self._settle)

    def _settle(self) -> None:
        held, self._held = self._held, None
        if held is not None and held[0].is_attached:
            view, offset = held
            self.scroll_to(y=view.virtual_region.y - offset, animate=False, immediate=True)
        self._changing = False
        if self.is_on_screen and self.max_scroll_y == 0:   # too short to scroll: no scroll would reach its top
            self._extend_soon(top=True)

    # ---- reaching an edge --------------------------------------------------------------------------------------
    def _extend_soon(self, *, top: bool) -> None:
        more = self.start > 0 if top else self.end < len(self._messages())
        if more and not self._changing:
            self._changing = True
            self.app.call_later(self._extend, top)

    async def _extend(self, top: bool) -> None:
        # Not attached: the tab closed before its turn came.
        if not self.is_attached or not await (self.older() if top else self.newer()):
            self._changing = False

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value <= 0 < old_value:
            self._extend_soon(top=True)
        elif old_value < self.max_scroll_y <= new_value:
            self._extend_soon(top=False)

    def scroll_end(self, *args, **kwargs) -> None:
        super().scroll_end(*args, **kwargs)
        # It anchors the list to its end, which Textual's layout then keeps without a watched change.
        self.call_after_refresh(self._extend_soon, top=False)

    def on_mouse_scroll_up(self, _: events.MouseScrollUp) -> None:
        if self.scroll_y <= 0:   # already at the top: the wheel asks for more all the same
            self._extend_soon(top=True)

    def on_mouse_scroll_down(self, _: events.MouseScrollDown) -> None:
        if self.scroll_y >= self.max_scroll_y:
            self._extend_soon(top=False)
