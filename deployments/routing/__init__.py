"""Schedule-affinity routing of the GPU worker deployment, in four rooms.

A request's AdaLN plans depend only on its sampling schedule, so requests of one schedule sent to one replica
find that replica's plan slab warm. The caller names the schedule on the handle call (``schedule_key=`` of
``Worker.denoise_stream`` / ``generate_stream``: ``deployments/generation.py``) and the worker deployment opts in
with ``RequestRouterConfig(request_router_class=ScheduleAffinityRouter, request_router_kwargs={...})``.

- ``report``: what a replica reports through ``record_routing_stats()`` (its load, its slab, its service costs)
  and how the router reads it back; the one wire form between the two sides.
- ``reporter``: the replica side, a mixin of the worker deployment that produces the report.
- ``policy``: pure ranking functions (no Ray): rendezvous hashing with bounded load, and the slab order sorted by
  when the request would start.
- ``router``: the ``RequestRouter`` living in every process that holds a worker handle, its options
  (``options``) and the per-process counters (``registry``).
"""
