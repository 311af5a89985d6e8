"""The bench's fixed workload: one realistic system prompt of an exact length, distinct questions, token ids."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pagedchat.bench.options import BenchError
from pagedchat.engine.chat_template import render_chat

SYSTEM_POLICY = """\
You are Harbor, the support assistant of Northwind Outfitters, an online shop for outdoor clothing and camping \
gear. You answer customers in the chat window of the shop's website and mobile app. Follow this policy.

Tone and format. Be warm, direct and brief: two to five sentences for simple questions, a short numbered list \
for step-by-step instructions. Use the customer's name when they give it. Never use sarcasm, and do not \
apologise more than once per conversation. Write prices in the customer's currency with two decimals, dates as \
"12 March 2025", and sizes exactly as printed on the size chart.

Orders and delivery. Standard delivery takes three to five working days within the country and costs 4.95, \
free above 60.00. Express delivery arrives the next working day when ordered before 14:00 and costs 9.95. You \
may look up an order only after the customer gives both the order number, which starts with NW followed by \
eight digits, and the email address used at checkout. If a parcel is more than five working days late, offer \
to open a carrier investigation; if it is more than ten days late, offer a replacement or a full refund.

Returns and refunds. Unworn items with their tags may be returned within 30 days of delivery for a full refund; \
sale items within 14 days. Footwear must come back in its original box. Refunds go to the original payment \
method within five working days of the return arriving at our warehouse. Opened sleeping bags, water filters \
and underwear cannot be returned for hygiene reasons unless they are faulty.

Warranty and safety. Tents, backpacks and jackets carry a two-year warranty against manufacturing defects. \
Never advise on using stoves, heaters or lanterns inside a tent or any closed space: tell the customer that \
this risks carbon monoxide poisoning and point to the product manual. For questions about avalanche gear, \
climbing protection or first aid, give general information only and recommend a certified instructor.

Privacy and limits. Never ask for full card numbers, passwords or security codes, and never repeat personal \
data the customer has not typed in this conversation. Do not promise discounts, price matches or delivery \
dates that this policy does not allow. If a request falls outside this policy, or the customer asks for a \
person, offer a hand-over to the human team, available Monday to Saturday from 08:00 to 20:00, and summarise \
the case in one sentence so that nobody has to ask the customer twice.
"""

QUESTIONS = [
    "My order NW20481377 was due on Tuesday and still hasn't arrived. What can you do?",
    "Can I return a pair of hiking boots I wore once on a short walk around the block?",
    "What is the difference between the 2-person and the 3-person Trailhead tent besides the size?",
    "Is it safe to run a small gas heater inside my tent if I keep the door half open?",
    "How long does a refund take once you receive my return, and where does the money go?",
    "I bought a sleeping bag in the sale ten days ago and it's too short. Can I swap it for a longer one?",
    "Which jacket would you recommend for autumn hiking in the rain when it's around eight degrees?",
    "Do you ship express on Saturdays, and what time do I need to order by?",
    "The zip on my backpack broke after eighteen months of normal use. Is that covered?",
    "What should I pack for a first overnight camping trip in spring with two children?",
    "Can you give me a discount if I buy a tent, two sleeping bags and a stove together?",
    "How do I know which size of trail running shoe to order if I'm usually between two sizes?",
    "I typed the wrong delivery address for order NW31975520. Can it still be changed?",
    "Is the Alpine 45 backpack carry-on size for most European airlines?",
    "My water filter arrived with a cracked housing. I opened it before I noticed. Can I return it?",
    "What is your warranty on tent poles, and what do I do if one snaps in strong wind?",
    "I'd like to speak to a person about a complaint. When is your team available?",
    "How should I wash and re-proof a waterproof shell jacket so it keeps beading water?",
    "Can you explain how to pitch a tunnel tent alone when it's windy?",
    "Do you price-match a cheaper offer I found on another website for the same stove?",
    "What's the warmest sleeping bag you sell that still packs smaller than a loaf of bread?",
    "My refund was approved a week ago but I still don't see it on my card. What's going on?",
    "Which headlamp would you suggest for night hikes, and how long do the batteries last?",
    "I'm planning a winter hut trip. What avalanche safety gear do I need to bring?",
]


WARM_QUESTION = "Which of your tents is the lightest one for a solo bikepacking trip, and what does it weigh?"


@dataclass(frozen=True)
class Workload:
    system_ids: list[int]          # the shared prefix, exactly system_tokens long
    questions: list[str]           # one per chat, for the largest concurrency
    prompts: list[list[int]]       # system_ids + that chat's user turn
    head: list[int]                # template tokens before the system text (part of system_ids)
    tail: list[int]                # template tokens after it (part of system_ids)
    post: list[int]                # template tokens after the user text
    encode: Callable[[str], list[int]]

    def cold_prefix(self, k: int) -> list[int]:
        """A system prompt of the same length whose first page differs from the real one's and from every other
        cold_prefix(j)'s, so it shares no page with them: a cold start for the prefix cache."""
        body = self.system_ids[len(self.head):len(self.system_ids) - len(self.tail)]
        marked = (self.encode(f"[{k}] ") + body)[:len(body)]
        return self.head + marked + self.tail

    def user_turn(self, question: str) -> list[int]:
        return self.encode(question) + self.post


_SYS, _USR = "\x00SYSTEM\x00", "\x00USER\x00"


def _template_parts(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Token ids around the system text, between it and the user text, and after the user text."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    if getattr(tokenizer, "chat_template", None):
        try:
            messages = [{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}]
            text = render_chat(tokenizer, messages)
        except Exception:
            text = ""
        if text.count(_SYS) == 1 and text.count(_USR) == 1 and text.index(_SYS) < text.index(_USR):
            pre, rest = text.split(_SYS)
            mid, post = rest.split(_USR)
            return enc(pre), enc(mid), enc(post)
    bos = tokenizer.encode("", add_special_tokens=True)
    return list(bos), enc("\n\n"), enc("\n")


def build_workload(tokenizer, system_tokens: int, num_chats: int, seed: int) -> Workload:
    head, mid, post = _template_parts(tokenizer)
    body_len = system_tokens - len(head) - len(mid)
    if body_len < 1:
        raise BenchError(f"--system-tokens {system_tokens} is too short: this model's chat template alone takes "
                         f"{len(head) + len(mid)} tokens around the system prompt")
    policy = tokenizer.encode(SYSTEM_POLICY, add_special_tokens=False)
    body = list(policy)
    while len(body) < body_len:  # pad by repeating the policy, paragraph-separated
        body += tokenizer.encode("\n\n", add_special_tokens=False) + policy
    system_ids = head + body[:body_len] + mid
    rng = random.Random(seed)
    order = rng.sample(QUESTIONS, len(QUESTIONS))
    questions = [order[i % len(order)] + (f" (Question {i // len(order) + 1}.)" if i >= len(order) else "")
                 for i in range(num_chats)]
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [system_ids + encode(q) + post for q in questions]
    return Workload(system_ids, questions, prompts, head, mid, post, encode)

