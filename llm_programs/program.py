"""Programs: an async function of a State, made runnable by `@function`.

    @function
    async def qa(s, question):
        s.user(question)
        await s.assistant(gen("answer", max_tokens=64))

    state = qa.run(router, question="...")                 # sync (its own event loop)
    state = await qa.arun(router, question="...")          # async
    states = qa.run_batch(router, [{"question": q} for q in qs], concurrency=8)
    async for piece in qa.stream(router, question="..."):  # each gen's text as it comes
        ...

The core is async; `run` and `run_batch` are `asyncio.run` around `arun` and
`arun_batch`, for scripts. `arun_batch` runs at most `concurrency` programs at once, so a
batch of thousands never opens thousands of requests.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable
from typing import Any, Literal, overload

from llm_programs.router import Router
from llm_programs.state import Piece, State, gather_all

ProgramFunc = Callable[..., Coroutine[Any, Any, Any]]


class Program:
    def __init__(self, func: ProgramFunc):
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"@function: {getattr(func, '__name__', func)!r} must be an "
                "`async def` taking the state first"
            )
        self.func, self.name = func, func.__name__
        # typeshed wants a callable wrapper; update_wrapper copies attributes onto any object.
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    async def arun(self, router: Router | str, /, *args: Any, **kwargs: Any) -> State:
        """Run once; the final state. Errors propagate (a ProgramError names the call).
        `router`: a Router, or a base URL for one with the default settings."""
        router = as_router(router)
        async with router.session():
            return await self._run(State(router, self.name), args, kwargs)

    @overload
    async def arun_batch(
        self,
        router: Router | str,
        inputs: Iterable[dict[str, Any]],
        *,
        concurrency: int = 8,
        return_exceptions: Literal[False] = False,
    ) -> list[State]: ...

    @overload
    async def arun_batch(
        self,
        router: Router | str,
        inputs: Iterable[dict[str, Any]],
        *,
        concurrency: int = 8,
        return_exceptions: bool,
    ) -> list[State | BaseException]: ...

    async def arun_batch(
        self,
        router: Router | str,
        inputs: Iterable[dict[str, Any]],
        *,
        concurrency: int = 8,
        return_exceptions: bool = False,
    ) -> list[State] | list[State | BaseException]:
        """Run once per keyword dict of `inputs`, at most `concurrency` at a time; the
        states in input order. The first error cancels the rest and is raised, unless
        `return_exceptions`: then each failed run's exception takes its place."""
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency: must be an integer >= 1, got {concurrency!r}")
        inputs, router = list(inputs), as_router(router)
        bound = asyncio.Semaphore(concurrency)

        async def one(i: int, kwargs: dict[str, Any]) -> State | BaseException:
            async with bound:
                state = State(router, f"{self.name}#{i}")
                try:
                    return await self._run(state, (), kwargs)
                except Exception as e:
                    if not return_exceptions:
                        raise
                    return e

        async with router.session():
            return await gather_all(one(i, kw) for i, kw in enumerate(inputs))

    def run(self, router: Router | str, /, *args: Any, **kwargs: Any) -> State:
        return _sync(self.arun(router, *args, **kwargs))

    @overload
    def run_batch(
        self,
        router: Router | str,
        inputs: Iterable[dict[str, Any]],
        *,
        concurrency: int = 8,
        return_exceptions: Literal[False] = False,
    ) -> list[State]: ...

    @overload
    def run_batch(
        self,
        router: Router | str,
        inputs: Iterable[dict[str, Any]],
        *,
        concurrency: int = 8,
        return_exceptions: bool,
    ) -> list[State | BaseException]: ...

    def run_batch(
        self, router: Router | str, inputs: Iterable[dict[str, Any]], **options: Any
    ) -> list[State] | list[State | BaseException]:
        return _sync(self.arun_batch(router, inputs, **options))

    def stream(self, router: Router | str, /, *args: Any, **kwargs: Any) -> Streamed:
        """Run once with every gen streamed; iterate for the pieces (`Piece`: the call,
        the gen's name, the text), then read `.state`."""
        return Streamed(self, as_router(router), args, kwargs)

    async def _run(self, state: State, args: tuple, kwargs: dict[str, Any]) -> State:
        state.returned = await self.func(state, *args, **kwargs)
        await state.finish()
        return state


class Streamed:
    """One streamed run: an async iterator of Pieces, then `.state`. The run starts with
    the iteration; an error of the program is raised from it. To stop early, leave the
    loop and `await run.aclose()` (or use `contextlib.aclosing(run)`): the run is
    cancelled, its requests with it."""

    def __init__(self, program: Program, router: Router, args: tuple, kwargs: dict[str, Any]):
        self.program, self.router = program, router
        self.args, self.kwargs = args, kwargs
        self.state: State | None = None
        self._pieces: AsyncGenerator[Piece, None] | None = None

    def __aiter__(self) -> AsyncGenerator[Piece, None]:
        if self._pieces is None:
            self._pieces = self._run()
        return self._pieces

    async def aclose(self) -> None:
        if self._pieces is not None:
            await self._pieces.aclose()

    async def _run(self) -> AsyncGenerator[Piece, None]:
        queue: asyncio.Queue[Piece | None] = asyncio.Queue()

        async def main() -> State:
            async with self.router.session():
                state = State(self.router, self.program.name, queue.put_nowait)
                return await self.program._run(state, self.args, self.kwargs)

        task = asyncio.create_task(main())
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (piece := await queue.get()) is not None:
                yield piece
            self.state = await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def function(func: ProgramFunc) -> Program:
    """Make `async def f(s, ...)` a Program."""
    return Program(func)


def as_router(router: Router | str) -> Router:
    return Router(router) if isinstance(router, str) else router


def _sync(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "run/run_batch start their own event loop; inside a running loop, "
        "await arun/arun_batch instead"
    )
