"""call_soon_any_thread: a callback scheduled from the loop's own thread does not write the
loop's self-pipe (no extra pass of the loop); from another thread it wakes the loop."""

import asyncio
import threading

from overlap.loop_calls import call_soon_any_thread


def test_a_callback_from_the_loops_own_thread_does_not_write_its_self_pipe():
    loop = asyncio.new_event_loop()
    writes = []
    real = loop._write_to_self
    loop._write_to_self = lambda: (writes.append(threading.current_thread()), real())[1]
    got: list[str] = []

    async def main() -> None:
        done = asyncio.Event()
        call_soon_any_thread(loop, got.append, "own thread")
        await asyncio.sleep(0)
        assert got == ["own thread"] and writes == []  # ran in the next pass, no pipe write
        worker = threading.Thread(target=call_soon_any_thread,
                                  args=(loop, lambda: (got.append("worker"), done.set())))
        worker.start()
        await asyncio.wait_for(done.wait(), 10)  # woken from its wait by the pipe
        worker.join()
        assert got == ["own thread", "worker"] and len(writes) == 1

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
