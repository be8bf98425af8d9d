"""`VerifyGraphShapes`: which verify graphs a graphed target has captured, seen from the engine.

A graphed target captures one CUDA graph per (batch bucket, tree-token bucket, cache-row
bucket) the first time a step meets it (`models.cuda_graphs.verify_bucket`); on the H200 a
capture costs ~18 ms, five steps of the bundled pair. The start-up calibration captures every
width at short contexts, but once the batch's contexts cross into the next row bucket every
width is new again. The allocator's widths vary step to step (9, 17, 20, 33 nodes...): an
adaptive budget that verified each at its own width paid a capture per width (20 ms steps in
a 4 ms stream at 256 tokens on the H200). A step may verify only in a graph already captured
for its batch and context, or in its ceiling's own bucket (`allowed_buckets`): a tree narrower
than the ceiling is padded to the nearest of those. So a bucket captures at most one graph per
ceiling the gate takes there (a handful of powers of two), and a width met first never caps the
ceilings after it (the sweep at c = 8 verified 15 nodes a step for a whole run where the gate
chose 32). Near the end of the cache, where a ceiling's bucket would read past it, the step
keeps to the captured graphs that fit.
"""

from collections.abc import Iterable, Sequence

from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS, pick_bucket, row_bucket, verify_bucket


class VerifyGraphShapes:
    """The verify shapes a graphed target has run, as its graph keys."""

    def __init__(self, token_buckets: Sequence[int], max_seq_len: int) -> None:
        self.token_buckets = tuple(token_buckets)
        self.max_seq_len = max_seq_len
        # padded batch -> cache rows -> the tree-token buckets captured there.
        self._captured: dict[int, dict[int, set[int]]] = {}
        # padded batch -> the tree-token buckets captured at any rows, ascending (kept here, not
        # gathered again by every step's lookup).
        self._buckets_of_batch: dict[int, tuple[int, ...]] = {}

    def record(self, batch_size: int, num_nodes: int, max_start: int) -> bool:
        """A verify of `batch_size` trees padded to `num_nodes` nodes ran at `max_start`; True
        when its graph is new (the target captures it in that verify, whose time is then the
        capture's: ~18 ms on the H200 against a 1.5 ms forward)."""
        key = verify_bucket(batch_size, num_nodes, max_start, self.max_seq_len)
        if key is None:
            return False
        padded_batch, padded_nodes, num_rows = key
        captured = self._captured.setdefault(padded_batch, {}).setdefault(num_rows, set())
        if padded_nodes in captured:
            return False
        captured.add(padded_nodes)
        buckets = self._buckets_of_batch.get(padded_batch, ())
        if padded_nodes not in buckets:
            self._buckets_of_batch[padded_batch] = tuple(sorted((*buckets, padded_nodes)))
        return True

    def record_all(self, shapes: Iterable[tuple[int, int]], max_start: int) -> None:
        """Verifies of each `(batch_size, num_nodes)` of `shapes` ran at `max_start` (a start-up
        calibration's or warm-up's, on scratch prompts of that length)."""
        for batch_size, num_nodes in shapes:
            self.record(batch_size, num_nodes, max_start)

    def captured_buckets(self, batch_size: int, max_start: int, below: int | None = None) -> tuple[int, ...]:
        """Tree-token buckets whose graph exists for this batch and context, ascending (`below`:
        only those smaller than it)."""
        padded_batch = pick_bucket(batch_size, BATCH_BUCKETS) or 0
        captured = self._captured.get(padded_batch)
        if not captured:
            return ()
        found = []
        # Only the buckets captured at some context are looked up (a handful: the ceilings the
        # gate took), each at the rows its tree reads (a wider tree may read the next bucket).
        for bucket in self._buckets_of_batch[padded_batch]:
            if below is not None and bucket >= below:
                break
            num_rows = row_bucket(max_start + bucket, self.max_seq_len)
            if num_rows is not None and bucket in captured.get(num_rows, ()):
                found.append(bucket)
        return tuple(found)

    def allowed_buckets(self, batch_size: int, max_start: int, ceiling: int) -> tuple[int, ...] | None:
        """Tree-token buckets a step of trees of at most `ceiling` draft nodes may verify in,
        ascending: the captured ones below the ceiling's bucket, and that bucket (a new graph the
        first time). Near the end of the cache, where the ceiling's bucket would read past it,
        the captured ones alone (the trees are cut to the widest). None where the batch has no
        graphs (past the largest batch bucket: eager at any width), or, near the end of the
        cache, none is captured (the widths are free there)."""
        if pick_bucket(batch_size, BATCH_BUCKETS) is None:
            return None
        wanted = pick_bucket(ceiling + 1, self.token_buckets)
        if wanted is None or row_bucket(max_start + wanted, self.max_seq_len) is None:
            return self.captured_buckets(batch_size, max_start) or None
        # Only the buckets below the ceiling's are looked up: the answer holds no other (the
        # scan of every bucket was 0.03-0.04 ms of every adaptive step on the H200's host).
        return (*self.captured_buckets(batch_size, max_start, below=wanted), wanted)

    @staticmethod
    def padded_nodes(num_nodes: int, buckets: Sequence[int] | None) -> int | None:
        """The captured bucket a tree of `num_nodes` nodes is padded to (None: the target's
        own padding), so the verify runs a graph that exists."""
        return None if buckets is None else pick_bucket(num_nodes, buckets)
