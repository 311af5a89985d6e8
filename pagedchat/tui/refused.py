"""A reply the backend refused after taking it: the engine process answers a start after submit has returned (so
that the UI never waits on it), and a refusal (a prompt too long for the context, a fork of a reply that has
just ended) then comes as the reply's one update. The chat is put back as it was before the start."""

from __future__ import annotations

from pagedchat.tui import context


async def put_back(chat, error: Exception) -> None:
    """In `chat` (a ChatView): the messages the start replaced come back, and the message it sent goes back to an
    empty input; a forked branch answers its question afresh instead."""
    session, reply = chat.session, chat.session.reply
    replaced, index = reply.replaced, reply.index
    reply.end()
    chat.services.changed(session)
    if replaced is None:
        chat.notify(f"Cannot fork this reply ({error}); answering its question afresh.", severity="warning")
        await chat.start_reply(keep=index)
        return
    record = session.record
    chat.services.saver.removed(record, session.put_back(replaced))
    chat.save(*range(replaced.keep, len(record.messages)), row=True)
    await chat.truncate(replaced.keep)
    for i in range(replaced.keep, len(record.messages)):
        await chat.add_message(record.messages[i], i)
    back = replaced.ask is not None and not chat.prompt.text
    if back:
        chat.prompt.text = replaced.ask
    chat.notify(context.refused_notice(error, back), severity="error", timeout=10)
