"""The broker: how tandem's processes exchange work through Redis.

Every service imports this package; it imports no other tandem package but ``host``
(child processes, atomic files). It
moves opaque payloads inside a small envelope it understands (group id and
policy version; the run id is the key namespace) and does the staleness and
delivery accounting on that envelope alone:

- ``keys``: every Redis key name, namespaced by run id.
- ``streams``: the ``prompts`` and ``trajectories`` streams with consumer
  groups, reclaim of abandoned entries, dead letters, idempotent acks.
- ``admission``: the staleness contract (docs/architecture.md section 3):
  admission on the rollout side, acceptance on the learner side.
- ``weight_versions``: the weight-version registry, its publish notification and
  retraction.
- ``ledger``: every group's life and every version event, written by the
  same scripts that change the state (``tandem audit`` checks it).
- ``lease``: one holder at a time (the learner of a run), renewed or lost.
- ``embedded``: a real ``redis-server`` child process for local runs.
"""

from broker.admission import Admission, Ticket, accept
from broker.keys import Keys
from broker.lease import Lease
from broker.streams import Delivery, Envelope, QueueFull, Stream, connect
from broker.weight_versions import WeightRegistry, WeightVersion

__all__ = [
    "Admission",
    "Delivery",
    "Envelope",
    "Keys",
    "Lease",
    "QueueFull",
    "Stream",
    "Ticket",
    "WeightRegistry",
    "WeightVersion",
    "accept",
    "connect",
]
