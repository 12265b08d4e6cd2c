"""Every timing constant of the stop and escalation ladders, in one place.

A stop (the stop button, ``--timeout``, a failed rank, a node gone) climbs a
ladder: each rung gives the one below it time to finish by itself before it
steps in, so the user gets the most complete story (every rank's stacks,
native frames too) and never waits for ever.  The rungs only work if their
times keep an order; :func:`check_order` states it, and tests/test_timing.py
holds the package to it (the documentation's numbers come from here too:
docs/design/timing.md is generated from this module).

In a rank's supervisor (one per run and node):
  stacks ``STACK_WAIT`` (the signal after ``STACK_ASK_WAIT`` for a rank
  whose heartbeat thread cannot dump them), native frames ``NATIVE_WAIT``, then SIGTERM and
  ``RANK_GRACE`` before SIGKILL.
In the kernel (``run_handle``), over the supervisor:
  ``STOP_WAIT`` after a stop, SIGUSR2 (kill the ranks now), ``KILL_WAIT``,
  then the kernel SIGKILLs everything; ``--timeout`` + ``TIMEOUT_SLACK``
  starts the same ladder if the supervisor did not stop the run itself.
A session's cell (``session_supervisor``): ranks recalled to their prompt
  (``RECALL_WAIT``, a second SIGINT after ``FORCE_AFTER``), inside the
  kernel's ``SESSION_STOP_WAIT``.
Slurm (``slurm``): the kernel tells every node's agent to stop, and after
  ``SLURM_STOP_WAIT`` to kill; each node runs the local ladder meanwhile;
  ``SLURM_KILL_WAIT`` later the run ends as forced.
A background run's ``h.stop()`` waits ``BACKGROUND_STOP_WAIT`` for all that.
A launcher that dies (kill -9): its supervisors and ranks die with it; the
  kernel kills what they started outside its tree, looking again for
  ``ESCAPED_KILL_WAIT`` (a process may fork as it is killed).
"""
from __future__ import annotations

# -- a run's supervisor ---------------------------------------------------------------
STACK_WAIT = 1.0          # at most this long for the ranks' Python stack dumps before SIGTERM
STACK_QUIET = 0.1         # stack pipes quiet this long: the dumps are complete
STACK_ASK_WAIT = 0.3      # a rank's heartbeat thread not back with its stacks by then: the signal (rank/liveness.py)
NATIVE_WAIT = 2.5         # at most this long for the native stacks of a timeout or a stall
RANK_GRACE = 3.0          # after SIGTERM, how long a rank gets before SIGKILL
REAP_WAIT = 5.0           # after "finished", how long ranks get to end before SIGKILL
DRAIN_WAIT = 2.0          # after a rank exits, how long its pipes get to reach EOF
RELEASE_DELAY = 0.05      # after "finished", ranks that succeeded stay parked this long
FLUSH_INTERVAL = 0.05     # output is batched like ipykernel's streams
STARTED_NOTE = 0.02       # one node: "started" goes with the ranks' first message, or after this (not while they start)
STALL_CHECK = 1.0         # seconds between looks at ranks that may be stalled
RESOURCE_SAMPLE = 0.5     # seconds between samples of each rank's CPU and memory (the view's rows)
BEAT_INTERVAL = 0.5       # a rank's interpreter heartbeat (rank/liveness.py): one GIL take per beat
THREADS_NOTE_AFTER = 2.0  # a cell's code done, its rank still waits for its threads: then it says so (rank/script_end.py)
PEERS_JOIN_WAIT = 2.0     # a rank that set up the world, at its end: at most this long for its peers' set-up (rank/pg_guard.py)
GROUP_DROP_DELAY = 0.5    # a destroyed group nothing else holds goes this long after its destroy (rank/pg_guard.py)
REMOTE_CHECK = 0.5        # several nodes: seconds between looks at the other nodes' failure flag
REMOTE_WAIT = 5.0         # a node that saw only consequences waits this long for the remote cause
NODE_GONE_AFTER = 3.0     # ... and a node whose count in node 0's store stood still this long went away
FINISH_WAIT = 60.0        # node 0 keeps the store this long for nodes still finishing
RDZV_POLL = 0.002         # several nodes: seconds between looks at the store
HOST_RETRY = 10.0         # a restart: how long node 0's port may still be held by its last round's store

# -- a session's supervisor -----------------------------------------------------------
RECALL_WAIT = 3.0         # after SIGINT, how long the ranks get to be back at their prompt
FORCE_AFTER = 2.0         # ... and when those still out get a second SIGINT
READY_WAIT = 120.0        # how long a session's ranks get to set up
NODE_BEAT = 0.5           # several nodes: how often a session's node counts itself in node 0's store
NODE_LOST_AFTER = 5.0     # ... and how long a node's count may stand still before its part is gone
NODE_STORE_WAIT = 2.0     # a session's store call (a beat) waits at most this long for node 0

# -- the kernel, over a local run ------------------------------------------------------
STOP_WAIT = 7.0           # after a stop, how long the supervisor gets to end the run by itself
KILL_WAIT = 2.0           # after SIGUSR2, how long before the kernel SIGKILLs everything
TIMEOUT_SLACK = 4.0       # past --timeout (or the rendezvous timeout), when the kernel steps in
GONE_DRAIN = 2.0          # after the supervisor exited, how long its last messages may take
DISPATCH_WAIT = 15.0      # how long the launcher gets to answer a run (it takes milliseconds)
PRELOAD_WAIT = 60.0       # how long it gets to import the modules it was asked to preload
ESCAPED_KILL_WAIT = 2.0   # a launcher died: how long the kernel looks again for what its runs left (a process may fork as it is killed)
SESSION_START_WAIT = 120.0  # how long a session's ranks get to start and set up
SESSION_STOP_WAIT = 12.0  # after a stop in a session cell, how long its supervisor gets
SESSION_TIMEOUT_SLACK = 15.0  # past a session cell's --timeout, when the kernel steps in (its ladder takes 10.1 s; room for a loaded machine)
SESSION_END_WAIT = 15.0   # %distributed_session stop: how long the ranks get to end
SESSION_SEND_WAIT = 10.0  # a cell or the stop waits this long to be taken (at once by a live supervisor; never: a gone one)
SESSION_SEND_SLICE = 0.1  # ... looking this often whether the supervisor is still there (a gone one: at once)
BACKGROUND_STOP_WAIT = 30.0  # h.stop(): how long it waits for the run to end
WAIT_TICK = 0.25          # while a cell waits (for the launcher, for the session), how often its view moves on

# -- the launcher process ---------------------------------------------------------------
END_WAIT = 15.0           # how long a new run waits for the ranks of earlier runs to end
COLLAPSE_AT_START = 0.1   # at start, how long the launcher moves its heap into huge pages (hugepages.py)
COLLAPSE_IDLE = 0.5       # ... the rest a huge page at a time, once nothing happened for this long
COLLAPSE_SLOW = 0.1       # ... and no more once one page took this much CPU (a cell waits for one step)

# -- Slurm: the kernel over every node, the agents ---------------------------------------
SLURM_START_WAIT = 180.0  # srun and every agent to start (each imports torch)
SLURM_STOP_WAIT = 10.0    # after a stop, how long the nodes get before the agents are told to kill
SLURM_KILL_WAIT = 5.0     # after that, how long before the run ends as forced
SLURM_GONE_WAIT = 5.0     # shutdown: how long srun gets to end by itself
SLURM_GONE_DRAIN = 2.0    # a node's supervisor exited: how long its last messages may take
SLURM_JOB_SETTLE = 4.5    # an ended job reads COMPLETING while Slurm kills its steps (our ranks get RANK_GRACE, more on a loaded machine): how long to ask again
SLURM_CANCEL_NOTICE = 10.0   # a cancelled allocation ends its cell within this (the documentation's promise)
AGENT_HEARTBEAT = 1.0     # ZMTP heartbeat between an agent and the kernel (5x that: its timeout)
SLURM_AGENT_LOOK = 1.0    # during a run, how often the kernel pings the agents of nodes still running (two misses: gone)
SLURM_AGENT_SETTLE = 1.0  # a node's run ended by SIGTERM: how long the kernel looks whether that node's agent is gone
AGENT_LOST_AFTER = 5.0    # without the kernel's connection this long, an agent ends
AGENT_IDLE_POLL = 0.2     # an agent's poll while nothing happens
AGENT_SEND_WAIT = 0.5     # a cell or stop to its node's session supervisor: taken at once, or the supervisor is gone

# -- the progress view (kernel_ext/kernel/behind.py) -------------------------------------
# A rank is "behind" when most ranks were where it is now this long ago: at
# least BEHIND_LAG seconds and BEHIND_SHARE of the time the bars have run;
# it stops being behind below half of that.  Ranks of one DDP job are at most a
# step apart; ranks 0.15 s apart read 25% apart on a 4-step bar for 0.15 s at
# each epoch boundary, which is nothing a person can act on.
BEHIND_LAG = 2.0
BEHIND_SHARE = 0.1


def check_order() -> list[str]:
    """The relations the ladders need, each as (holds, why); the ones that do not hold."""
    supervisor_stop = STACK_WAIT + NATIVE_WAIT + RANK_GRACE
    rules = [
        (supervisor_stop < STOP_WAIT,
         "a supervisor finishes a stop by itself (stacks, native stacks, SIGTERM grace) before the kernel "
         "escalates"),
        (STACK_WAIT + NATIVE_WAIT < TIMEOUT_SLACK,
         "at --timeout the supervisor has every rank's stacks before the kernel's backstop"),
        (STACK_QUIET < STACK_WAIT, "stack pipes are read until quiet within the stack wait"),
        (STACK_ASK_WAIT + STACK_QUIET < STACK_WAIT,
         "a rank whose heartbeat thread cannot dump (the GIL held in native code) gets the signal, and its "
         "dump is read, within the stack wait"),
        (supervisor_stop + RECALL_WAIT < SESSION_STOP_WAIT,
         "a session's supervisor recalls its ranks (or stops them) before the kernel escalates"),
        (FORCE_AFTER < RECALL_WAIT, "the second SIGINT comes within the recall wait"),
        (SESSION_SEND_SLICE < SESSION_SEND_WAIT,
         "a send to a session supervisor that died as it was sent ends when it is seen gone, not at the wait's end"),
        (STACK_WAIT + NATIVE_WAIT + RECALL_WAIT + STACK_ASK_WAIT + 3 * STACK_QUIET + RANK_GRACE
         < SESSION_TIMEOUT_SLACK,
         "at a session cell's --timeout its supervisor recalls the ranks (or loses the session, saying where "
         "they were) before the kernel's backstop blames the supervisor"),
        (STOP_WAIT + KILL_WAIT < SLURM_STOP_WAIT,
         "each node's own ladder ends a stop before the kernel tells the agents to kill"),
        (KILL_WAIT < SLURM_KILL_WAIT, "a node's kill lands before the run ends as forced"),
        (AGENT_SEND_WAIT < AGENT_HEARTBEAT,
         "an agent's send to a session supervisor that is gone holds its loop for less than a heartbeat"),
        (AGENT_LOST_AFTER >= 5 * AGENT_HEARTBEAT,
         "an agent gives up only after its heartbeat timed out (a busy kernel is not a gone one)"),
        (max(SESSION_STOP_WAIT + KILL_WAIT, SLURM_STOP_WAIT + SLURM_KILL_WAIT) < BACKGROUND_STOP_WAIT,
         "h.stop() waits long enough for any placement's ladder"),
        (REMOTE_CHECK < REMOTE_WAIT, "a node looks for the remote cause more than once while it waits"),
        (5 * REMOTE_CHECK <= NODE_GONE_AFTER < REMOTE_WAIT,
         "a node is said to have gone away only after it missed several beats, and within the wait for a "
         "remote cause"),
        (NODE_LOST_AFTER >= 5 * NODE_BEAT, "a session's node is lost only after it missed several beats"),
        (NODE_STORE_WAIT < NODE_LOST_AFTER, "a beat that waits for node 0 ends before node 0 counts as gone"),
        (COLLAPSE_AT_START < COLLAPSE_IDLE and COLLAPSE_SLOW <= COLLAPSE_AT_START,
         "the launcher is ready after a short first collapse, and a cell that arrives while it moves its "
         "heap waits for one step, never longer than that"),
        (PEERS_JOIN_WAIT < REAP_WAIT,
         "a rank that waits at its end for its peers' set-up ends by itself before the supervisor kills it"),
        (FLUSH_INTERVAL < STALL_CHECK, "output is flushed between stall checks"),
        (2 * BEAT_INTERVAL <= STALL_CHECK,
         "a rank whose interpreter runs has beaten at least once between two stall checks"),
        (SLURM_GONE_DRAIN + SLURM_JOB_SETTLE + RANK_GRACE < SLURM_CANCEL_NOTICE,
         "a cancelled allocation's cell ends (its nodes' SIGTERM grace, the drain, the job's final "
         "state) within the promised time"),
    ]
    return [why for holds, why in rules if not holds]
