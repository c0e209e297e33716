"""`make compose-test`: build the image, run compose.yaml for real, serve one chat completion.

Steps (each one fails the run with a message saying which):
  1. tools: docker, dockerd, Compose (v2 `docker compose` or 1.29 `docker-compose`) and
     debootstrap, from Debian's packages when missing (apt-get update once, then install)
  2. a Docker engine: when none answers, `dockerd` is started in the background (and
     stopped at the end)
  3. a local base image (images cannot be pulled here): `debootstrap --variant=minbase
     bookworm` with python3 and gcc + `docker import`, built once and kept (tag
     tandem-base:bookworm-gcc)
  4. the wheel folder (deploy/wheels), filled by `pip download` on the host, so that the
     image builds with `--network none`
  5. our image, `docker build --network none --build-arg BASE_IMAGE=tandem-base:bookworm-gcc`
  6. `up -d` with a private env file (free host ports; the stack makes its own secrets), then wait
     until every service's container reports healthy (Compose 1.29 has no `--wait`)
  7. chat completions through the router with the `openai` client, while subscribed to
     `tandem.kv.events.>` through the published NATS port: a short prompt (a KV event
     must arrive), then a long one that the router sends through the prefill worker (its
     KV crosses containers over the transfer engine; the prefill worker's event must
     arrive)
  8. `down -v` (always), and exit 0 only if every step passed

    python -m scripts.compose_test [--keep] [--timeout SECONDS]

Logs of the run: run/compose-test/ (compose logs, dockerd log, the env file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from scripts.compose_stack import (
    BASE_IMAGE,
    IMAGE,
    REPO,
    WORKDIR,
    Stack,
    StepFailed,
    build_image,
    ensure_base_image,
    ensure_dockerd,
    ensure_tools,
    fill_wheels,
    run,
    run_folder,
    step,
    tear_down,
)

LONG_PROMPT = (
    "Here is a list of facts. "
    + " ".join(f"Fact {i}: {i} times {i} is {i * i}." for i in range(40))
    + " Which number is fact 3 about?"
)


class KvEvents:
    """Every message on `tandem.kv.events.>`, with a wait for one that matches."""

    def __init__(self):
        self.events: list[dict] = []
        self._changed = asyncio.Event()

    async def collect(self, msg) -> None:
        self.events.append({"subject": msg.subject, **json.loads(msg.data)})
        self._changed.set()

    async def wait_for(self, match, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            found = next((e for e in self.events if match(e)), None)
            left = deadline - time.monotonic()
            if found is not None or left <= 0:
                return found
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                pass


async def chat(client, model: str, prompt: str, timeout: float):
    """One greedy chat completion; retried while the router says it cannot serve yet."""
    import openai

    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
            break
        except (openai.APIConnectionError, openai.APIStatusError) as e:
            status = getattr(e, "status_code", None)
            if time.monotonic() > deadline or status not in (None, 429, 503):
                raise StepFailed(f"chat completion failed: {e}") from None
            print(f"   not served yet ({status or e}); retrying", flush=True)
            await asyncio.sleep(3)
    text = reply.choices[0].message.content or ""
    print(f"   completion {reply.usage.prompt_tokens}+{reply.usage.completion_tokens} "
          f"tokens: {text!r}", flush=True)  # fmt: skip
    if not text.strip() or reply.usage.completion_tokens < 1:
        raise StepFailed(f"empty completion: {reply}")
    return reply


async def completion_and_kv_event(stack: Stack, timeout: float) -> None:
    """A short prompt (the decode worker prefills it), then a long one, which the router
    sends through the prefill worker: its KV crosses containers over the transfer engine.
    KV events must arrive for both."""
    import nats
    import openai

    nc = await nats.connect(stack.nats_url, connect_timeout=10, max_reconnect_attempts=3,
                            **stack.cli_identity())  # fmt: skip
    kv = KvEvents()
    await nc.subscribe("tandem.kv.events.>", cb=kv.collect)
    await nc.flush()
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{stack.ports['router']}/v1",
            api_key="compose-test",
            max_retries=0,
            timeout=timeout,
        )
        model = "default"
        try:
            models = await client.models.list()
            model = models.data[0].id if models.data else model
        except openai.OpenAIError as e:
            print(f"   GET /v1/models failed ({e}); asking for model {model!r}", flush=True)
        await chat(client, model, "What is the capital of France?", timeout)
        if await kv.wait_for(lambda e: True, timeout=30) is None:
            raise StepFailed("no KV event on tandem.kv.events.> within 30 s of the completion")
        await chat(client, model, LONG_PROMPT, timeout)
        from_prefill = await kv.wait_for(lambda e: ".prefill-" in e["subject"], timeout=30)
        if from_prefill is None:
            raise StepFailed("the long prompt left no KV event of a prefill worker")
        seen = sorted({(e["subject"].split(".")[-1].rsplit("-", 2)[0], e.get("kind"),
                        e.get("tier")) for e in kv.events})  # fmt: skip
        print(f"   {len(kv.events)} KV events (source, kind, tier): {seen}", flush=True)
    finally:
        await nc.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="make compose-test", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to get healthy")
    args = parser.parse_args()
    run_folder(WORKDIR)
    dockerd, stack, code = None, None, 1
    started = time.monotonic()
    try:
        step("tools (Debian packages)")
        compose = ensure_tools(need_debootstrap=True)
        print("compose: " + " ".join(compose), flush=True)
        step("Docker engine")
        dockerd = ensure_dockerd(WORKDIR)
        step(f"base image {BASE_IMAGE}")
        ensure_base_image()
        step("wheel folder deploy/wheels (pip download on the host)")
        fill_wheels(REPO / "deploy" / "wheels")
        step(f"image {IMAGE} (docker build --network none)")
        build_image()
        stack = Stack(compose)
        step("compose up -d")
        stack("down", "-v", "--remove-orphans", check=False)
        stack("up", "-d", "--no-build")
        step("waiting for every service to be healthy")
        stack.wait_healthy(args.timeout)
        user = run(["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"], capture=True)
        if user.strip() == "0":
            raise StepFailed("the image runs as root")
        step("chat completion through the router; a KV event on NATS")
        asyncio.run(completion_and_kv_event(stack, timeout=120))
        code = 0
    except StepFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        tear_down(stack, dockerd, keep=args.keep, failed=code != 0)
    verdict = "PASSED" if code == 0 else "FAILED"
    print(f"\ncompose-test {verdict} in {time.monotonic() - started:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
