"""Calling a rollout's webhooks (graft.rollout.hooks says which, when, and what their answers mean).

A gate is awaited, each try under the hook's timeout, with a short backoff between tries; its
answer comes back as data, never as an exception, so a hook that hangs or fails costs its own
rollout at most timeout x tries per reconciliation and nothing else (each rollout reconciles under
its own lock). Fired hooks go through the outbox.
"""
from __future__ import annotations

import asyncio
from typing import Any

import httpx

from graft.operator.outbox import Delivery, Outbox
from graft.rollout.hooks import Hook, HookAnswer, hook_body

BACKOFF = 0.5
MAX_BODY = 200          # characters of a refusal's body kept in the rollout's message


class HookCaller:
    def __init__(self, outbox: Outbox, transport: httpx.AsyncBaseTransport | None = None):
        self.outbox = outbox
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def ask(self, hook: Hook, payload: dict[str, Any]) -> HookAnswer:
        """Call a gate: ok on a 2xx; otherwise why not, after the hook's retries."""
        body = hook_body(hook, payload)
        answer = HookAnswer(hook.name, False, None, "not called")
        for attempt in range(hook.retries + 1):
            if attempt:
                await asyncio.sleep(BACKOFF * 2 ** (attempt - 1))
            try:
                r = await self._client.post(hook.url, json=body, timeout=hook.timeout)
            except httpx.TimeoutException:
                answer = HookAnswer(hook.name, False, None, f"no answer within {hook.timeout:g}s")
                continue
            except httpx.HTTPError as e:
                answer = HookAnswer(hook.name, False, None, f"{type(e).__name__}: {e}"[:MAX_BODY])
                continue
            if r.is_success:
                return HookAnswer(hook.name, True, r.status_code, "")
            text = " ".join(r.text.split())[:MAX_BODY]
            answer = HookAnswer(hook.name, False, r.status_code, f"HTTP {r.status_code}" + (f": {text}" if text else ""))
            if r.status_code < 500 and r.status_code not in (408, 429):
                break           # a refusal is an answer: asking again now would not change it
        return answer

    def fire(self, hook: Hook, payload: dict[str, Any]) -> None:
        """Send a fired hook in the background."""
        self.outbox.send(Delivery(hook.url, hook_body(hook, payload), what=f"hook {hook.name}",
                                  timeout=hook.timeout, retries=hook.retries))
