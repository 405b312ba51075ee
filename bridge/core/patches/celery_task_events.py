"""Task events that reach Flower under every pool: Celery's buffered event path made thread-safe.

Under ``-P threads`` task threads append to the event buffer while the loop publishes it, and Celery 5.6's
``EventDispatcher.flush`` empties the whole buffer afterwards, erasing what was appended meanwhile (Flower
then shows tasks ``STARTED`` forever); the consumer also schedules flushes from task threads without the
loop's lock. ``install`` fixes both through Celery's extension points (``app.events_cls``,
``worker_consumer``): the same events, batching and order as Celery's, so prefork sees no difference. Celery 5.7
fixes both upstream; docs/operations.md, "Flower", has the measurement. Registered in ``bridge.core.patches``.
"""

from __future__ import annotations

from celery import Celery
from celery.app.events import Events
from celery.events.dispatcher import EventDispatcher
from celery.worker.consumer import Consumer
from vine import promise

__all__ = ["EventsConsumer", "ThreadSafeEventDispatcher", "install"]


class ThreadSafeEventDispatcher(EventDispatcher):
    """``EventDispatcher`` whose flush never erases an event appended while it publishes.

    Appends (``send``, from any thread) stay lock-free as in Celery: ``list.append``, ``list(events)``
    and ``del events[:n]`` are each atomic under the GIL, and flushes are serialised by the dispatcher's
    own ``mutex``, so removing exactly the published prefix leaves later appends for the next flush.
    """

    def flush(self, errors: bool = True, groups: bool = True) -> None:
        if errors:
            with self.mutex:
                # Taken and cleared before re-publishing: a publish that fails again is re-buffered by
                # ``_publish`` for the next flush instead of being cleared with the rest (Celery 5.6 does).
                pending = list(self._outbound_buffer)
                self._outbound_buffer.clear()
                for event, routing_key, _error in pending:
                    self._publish(event, self.producer, routing_key)
        if groups:
            with self.mutex:
                for group, events in list(self._group_buffer.items()):
                    if not events:
                        continue  # an empty ``task.multi`` carries nothing for a monitor
                    batch = list(events)
                    self._publish(batch, self.producer, f"{group}.multi")
                    del events[: len(batch)]


class WorkerEvents(Events):
    """``app.events`` of the worker app: its ``Dispatcher`` is the thread-safe one."""

    dispatcher_cls = ThreadSafeEventDispatcher


class EventsConsumer(Consumer):
    """The worker's consumer, scheduling an event flush through the loop's lock from any thread.

    Celery 5.6 adds the flush callback to ``hub._ready`` directly; from a task thread that add can race
    the loop swapping the set out (the flush is then skipped, or the loop iterates a set that changes
    size). ``hub.call_soon`` takes the loop's lock, and one reused promise keeps at most one pending flush
    in the ready set, as Celery's bound method does.
    """

    def on_send_event_buffered(self) -> None:
        if self.hub:
            flush = self.__dict__.get("_agl_flush_events")
            if flush is None:
                flush = self.__dict__.setdefault("_agl_flush_events", promise(self._flush_events))
            self.hub.call_soon(flush)


def install(app: Celery) -> None:
    """Make ``app``'s workers send every task event under every pool (call before the worker starts)."""
    if "events" in app.__dict__:  # ``app.events`` is a cached property: too late to swap its class
        raise RuntimeError("install() must run before the app's events are first used")
    app.events_cls = WorkerEvents
    app.conf.worker_consumer = f"{EventsConsumer.__module__}:{EventsConsumer.__qualname__}"
