"""The lines a child process writes to its stdout, for tests that drive a
child line by line.

``select()`` on the pipe cannot serve here: ``readline`` on a buffered text
stream reads every line that has arrived into Python's buffer, so a second
line written together with the first (a library's log line, then the
child's answer) is already out of the pipe, and ``select()`` then waits for
data that never comes. One thread reads the stream to its end and queues
each line; ``next`` waits for one with a deadline.
"""

import queue
import threading
import time


class ChildLines:
    def __init__(self, stream):
        self._lines = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True, name="child-lines")
        self._thread.start()

    def _pump(self, stream):
        try:
            for line in stream:
                self._lines.put(line)
        except ValueError:  # the stream closed under the loop by the test's cleanup
            pass
        finally:
            self._lines.put(None)  # end of stream: the child closed its stdout (exited)

    def next(self, deadline):
        """The next line, ``None`` at the end of the stream, or ``TimeoutError``
        once ``time.monotonic()`` passes ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            # What has arrived is still taken: the deadline bounds waiting only.
            try:
                return self._lines.get_nowait()
            except queue.Empty:
                raise TimeoutError from None
        try:
            return self._lines.get(timeout=left)
        except queue.Empty:
            raise TimeoutError from None
