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
A launcher that is closed (the kernel's end, a restart): it SIGTERMs its
  supervisors, SIGKILLs those still there after ``SHUTDOWN_STOP_WAIT`` and
  kills their orphans for up to ``SHUTDOWN_ORPHAN_WAIT``, all inside the
  kernel's ``LAUNCHER_CLOSE_WAIT`` before it SIGKILLs the launcher.
A session that is stopped: its supervisor lets its ranks end (``REAP_WAIT``,
  then SIGKILL and ``REAP_WAIT`` again) and sweeps their orphans
  (``ORPHAN_SWEEP_WAIT``), inside the kernel's ``SESSION_END_WAIT``; then it
  gets ``SESSION_GONE_WAIT`` to exit.

Every other wait, timeout and polling interval of the package is here too,
grouped by where it is used, so none hides in a module as a bare number
(tests/test_timing.py looks for those).
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
BATCH_HOLD = 0.05         # a node of a Slurm run: its messages wait at most this long to go as one (output, the end: at once)
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
RANKS_GONE_POLL = 0.05    # while a supervisor waits for its ranks to end, seconds between looks
ORPHAN_SWEEP_WAIT = 2.0   # at its end, how long a supervisor goes on killing its ranks' orphans (they come a generation at a time)
ORPHAN_SWEEP_POLL = 0.02  # ... seconds between two sweeps
RDZV_NOTE_EVERY = 1.0     # several nodes: while a node waits for the others, how often it tells the kernel
RDZV_NOTE_QUIET = 1.0     # ... and, nodes dispatched together (they usually meet at once), not before this

# -- the rendezvous store (supervisor/rendezvous.py) -------------------------------------
STORE_TRY_WAIT = 5.0      # the launcher's throwaway stores (does torch take a bound socket? the DNS fix): their timeout
STORE_OP_WAIT = 30.0      # a run's store: the timeout of each of its operations (node 0's: at least this)
HOST_RETRY_POLL = 0.05    # ... while node 0's port is still held (HOST_RETRY), seconds between tries
CONNECT_WAIT = 1.0        # another node: one attempt to reach node 0's store
CONNECT_SLACK = 1.0       # ... torch's client may block past its timeout: the attempt is given up this much later
PROBE_WAIT = 0.5          # a TCP connection to node 0's port (is anything listening?)
PORT_ASK_WAIT = 5.0       # whose port is it (a second node 0?): the whole question, however the other end behaves
PORT_ASK_STORE_WAIT = 2.0  # ... its store client's timeout
PORT_ASK_ROUND_WAIT = 1.0  # ... how long a node 0 that started the same moment gets to say its round
PORT_ASK_POLL = 0.05      # ... seconds between looks for that round

# -- a rank (kernel_ext/rank/) -----------------------------------------------------------
RANK_BURST_WINDOW = 0.1   # a rank printing BURST_LINES lines within this switches its stdout to block buffering (rank/rank_stdio.py)
RANK_FLUSH_INTERVAL = 0.05  # ... and its flusher thread then flushes this often
BAR_INTERVAL = 0.1        # seconds between two events of one progress bar (its first and last state always go) (rank/rank_bars.py)
STACK_LOCK_WAIT = 1.0     # a rank closing its stack pipe waits this long for a dump in progress (liveness.py)
MAIN_FRAME_POLL = 0.001   # a rank looking for its main thread's frame to leave a function: seconds between looks (liveness.py)
STORE_WAIT_FLOOR = 0.001  # a wait on the store at or past its deadline still gets this (never zero or less) (pg_guard.py)

# -- a session's supervisor -----------------------------------------------------------
RECALL_WAIT = 3.0         # after SIGINT, how long the ranks get to be back at their prompt
FORCE_AFTER = 2.0         # ... and when those still out get a second SIGINT
READY_WAIT = 120.0        # how long a session's ranks get to set up
NODE_BEAT = 0.5           # several nodes: how often a session's node counts itself in node 0's store
NODE_LOST_AFTER = 5.0     # ... and how long a node's count may stand still before its part is gone
NODE_STORE_WAIT = 2.0     # a session's store call (a beat) waits at most this long for node 0
READY_POLL = 0.5          # while a session's ranks set up, seconds between looks (its deadlines too)

# -- the kernel, over a local run ------------------------------------------------------
STOP_WAIT = 7.0           # after a stop, how long the supervisor gets to end the run by itself
KILL_WAIT = 2.0           # after SIGUSR2, how long before the kernel SIGKILLs everything
TIMEOUT_SLACK = 4.0       # past --timeout (or the rendezvous timeout), when the kernel steps in
GONE_DRAIN = 2.0          # after the supervisor exited, how long its last messages may take
HELD_SEND_WAIT = 1.0      # the kernel's word to a held rank's supervisor (let go): how long it may take to leave
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
CELL_HEARTBEAT = 0.25     # while a cell runs and nothing comes, how often its view moves on (its elapsed time)
BACKGROUND_STOP_POLL = 0.1  # h.stop(): seconds between looks whether the run ended
DEBUG_FOLLOW = 1.0        # h.debug(): after an answer, how long it waits for the rank's next question (pdb's n, s)
BACKGROUND_END_WAIT = 30.0  # the kernel's end, a session's stop: how long each stopped background run gets to end
SUPERVISOR_LOOK = 0.5     # no pidfd for a run's supervisor (Linux < 5.3): seconds between looks whether it is alive
FORCED_GONE_DRAIN = 0.2   # ... its messages' drain when the kernel killed it (nothing more is coming)
SESSION_GONE_WAIT = 5.0   # a session ended (stopped, lost): how long its supervisor gets to exit before it is killed
SESSION_GONE_POLL = 0.02  # ... seconds between looks
LAUNCHER_READY_WAIT = 120.0  # how long the kernel (or a node agent) waits for the launcher to be ready (it imports torch)
LAUNCHER_CLOSE_WAIT = 5.0  # the kernel closes the launcher: how long it gets to stop its runs and exit before SIGKILL
ESCAPED_KILL_POLL = 0.01  # ... seconds between looks for what a dead launcher's runs left (ESCAPED_KILL_WAIT)
ACCELERATE_CONFIG_WAIT = 120.0  # an accelerate config file is read in a subprocess (it imports torch and accelerate)

# -- the launcher process ---------------------------------------------------------------
END_WAIT = 15.0           # how long a new run waits for the ranks of earlier runs to end
SHUTDOWN_STOP_WAIT = 3.0  # the launcher's end: how long its supervisors get after SIGTERM before SIGKILL
SHUTDOWN_ORPHAN_WAIT = 1.5  # ... then how long it goes on killing their orphans (they come a generation at a time)
SHUTDOWN_ORPHAN_POLL = 0.01  # ... seconds between two looks
STORE_THREADS_WAIT = 2.0  # at start, how long the throwaway store's threads get to end (forks must not copy them)
STORE_THREADS_POLL = 0.005  # ... seconds between looks
COLLAPSE_AT_START = 0.1   # at start, how long the launcher moves its heap into huge pages (hugepages.py)
COLLAPSE_IDLE = 0.5       # ... the rest a huge page at a time, once nothing happened for this long
COLLAPSE_SLOW = 0.1       # ... and no more once one page took this much CPU (a cell waits for one step)
SPARE_FORK_DEFER = 0.020  # a run finished: its next spare waits this long (the kernel's reply, then the frontend's read of it)

# -- Slurm: the kernel over every node, the agents ---------------------------------------
SLURM_START_WAIT = 180.0  # srun and every agent to start (each imports torch)
SLURM_STOP_WAIT = 10.0    # after a stop, how long the nodes get before the agents are told to kill
SLURM_KILL_WAIT = 5.0     # after that, how long before the run ends as forced
SLURM_GONE_WAIT = 5.0     # shutdown: how long srun gets to end by itself
SLURM_GONE_DRAIN = 2.0    # a node's supervisor exited: how long its last messages may take
SLURM_JOB_SETTLE = 4.5    # an ended job reads COMPLETING while Slurm kills its steps (our ranks get RANK_GRACE, more on a loaded machine): how long to ask again
SLURM_CANCEL_NOTICE = 10.0   # a cancelled allocation ends its cell within this (the documentation's promise)
AGENT_HEARTBEAT = 1.0     # ZMTP heartbeat between an agent and the kernel (5x that: its timeout)
AGENT_HEARTBEAT_TIMEOUT = 5 * AGENT_HEARTBEAT  # ... an agent's connection with no heartbeat back for this long is dead
AGENT_LINGER = 2.0        # an agent closing its socket: how long its last messages get to leave
SLURM_AGENT_LOOK = 1.0    # during a run, how often the kernel pings the agents of nodes still running (two misses: gone)
SLURM_AGENT_SETTLE = 1.0  # a node's run ended by SIGTERM: how long the kernel looks whether that node's agent is gone
AGENT_LOST_AFTER = 5.0    # without the kernel's connection this long, an agent ends
AGENT_IDLE_POLL = 0.2     # an agent's poll while nothing happens
AGENT_SEND_WAIT = 0.5     # a cell or stop to its node's session supervisor: taken at once, or the supervisor is gone
SLURM_COMMAND_WAIT = 10.0  # scontrol, squeue, scancel: how long each may take
SLURM_JOB_POLL = 0.1      # ... an ending job (SLURM_JOB_SETTLE): seconds between asks
SLURM_START_SLICE = 0.5   # while the agents start, how long the kernel waits for one message before its checks
SLURM_PORT_WAIT = 30.0    # how long node 0's agent gets to name a free port
SLURM_RECEIVE_SLICE = 0.2  # ... (and while a session's ranks set up) how long the kernel waits for one message before its checks
SLURM_BEAT = 0.5          # a Slurm run with no view heartbeat: how often the kernel looks at its agents and deadlines
SLURM_AGENT_SETTLE_POLL = 0.02  # ... a node's run ended by SIGTERM (SLURM_AGENT_SETTLE): seconds between looks at its agent
HANDSHAKE_WAIT = 5.0      # a connection to the kernel's cluster-network ports not authenticated within this is closed (wire/transport.py)

# -- %distributed_doctor (kernel_ext/doctor/) --------------------------------------------
PTRACE_PROBE_WAIT = 5.0   # the ptrace probe (can native stacks be read?)
GPU_QUERY_WAIT = 5.0      # nvidia-smi, where NVML is missing
LOOPBACK_WAIT = 2.0       # a TCP connection over loopback
CPU_QUOTA_FRESH = 1.0     # a read of the CPU quota (cpu_quota.effective_cpus) is reused this long: one cell's checks,
                          # defaults and every rank's thread split read the cgroup files once, not five times

# -- the views (accel_magics/text_view.py, widgets/progress_view.py) ------------------------
TEXT_REFRESH = 0.2        # a plain-text view redraws at most this often
TEXT_PROGRESS_EVERY = 1.0  # ... and prints a rank's progress bar at most this often
VIEW_REFRESH = 0.2        # the widget view redraws its rows at most this often
PANE_INTERVAL = 0.4       # ... and its panes (at 1 s they lagged the rows visibly)

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
        (AGENT_LOST_AFTER >= AGENT_HEARTBEAT_TIMEOUT,
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
        (SPARE_FORK_DEFER < COLLAPSE_IDLE,
         "the spare deferred while the kernel delivers a run is forked before the idle launcher moves its heap"),
        (PEERS_JOIN_WAIT < REAP_WAIT,
         "a rank that waits at its end for its peers' set-up ends by itself before the supervisor kills it"),
        (FLUSH_INTERVAL < STALL_CHECK, "output is flushed between stall checks"),
        (BATCH_HOLD <= FLUSH_INTERVAL and BATCH_HOLD < SLURM_BEAT,
         "a Slurm node holds its messages no longer than output is batched anyway, and less than the "
         "kernel's beat"),
        (2 * BEAT_INTERVAL <= STALL_CHECK,
         "a rank whose interpreter runs has beaten at least once between two stall checks"),
        (SHUTDOWN_STOP_WAIT + SHUTDOWN_ORPHAN_WAIT < LAUNCHER_CLOSE_WAIT,
         "a closed launcher stops its supervisors (SIGTERM, then SIGKILL) and kills their orphans before the "
         "kernel SIGKILLs it"),
        (2 * REAP_WAIT + ORPHAN_SWEEP_WAIT < SESSION_END_WAIT,
         "a stopped session's supervisor ends its ranks (the last ones killed) and sweeps their orphans before "
         "the kernel's wait for the session's end runs out"),
        (PROBE_WAIT <= CONNECT_WAIT, "a node's look at node 0's port takes no longer than one attempt to reach it"),
        (PORT_ASK_STORE_WAIT + PORT_ASK_ROUND_WAIT < PORT_ASK_WAIT,
         "whose port it is: the store's own timeout and the wait for node 0's round end before the whole "
         "question is given up"),
        (SLURM_GONE_DRAIN + SLURM_JOB_SETTLE + RANK_GRACE < SLURM_CANCEL_NOTICE,
         "a cancelled allocation's cell ends (its nodes' SIGTERM grace, the drain, the job's final "
         "state) within the promised time"),
    ]
    return [why for holds, why in rules if not holds]
