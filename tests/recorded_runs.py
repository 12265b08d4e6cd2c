"""Message sequences of real runs, as the kernel received them (recorded with
the engine and a real launcher: gloo, two ranks; pids and times as they
were), and sequences of the other placements and modes in the same schema.

Fed to ``fold.RunFold`` by tests/test_fold.py: root cause and conclusion are
plain functions of these, tested in milliseconds.
"""

# One node, recorded: each made by this cell on 2 ranks (run.execute, a real launcher).
CODE = {
    "ok_value": "print('hi', os.environ['RANK']); int(os.environ['RANK']) + 41",
    "exception_rank1": "rank 1 raises ValueError('boom'), rank 0 sleeps",
    "sigkill_rank1": "rank 1 SIGKILLs itself, rank 0 sleeps",
    "timeout": "time.sleep(60) with --timeout 2",
    "rank_left_early": "init_process_group; rank 1 sys.exit(0); the others barrier()",
    "restart_attempt_0": "--max_restarts 1: rank 1 raises RuntimeError('flaky') in attempt 0 only",
    "restart_attempt_1": "(the same run's second attempt)",
}
LOCAL = {'exception_rank1': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5094, 1: 5095}, 'supervisor': 5093},
                     {'event': {'exc_type': 'ValueError',
                                'kind': 'failed',
                                'message': 'boom',
                                'secondary': False,
                                'timestamp': 1796214462.004096,
                                'traceback': 'Traceback (most recent call last):\n'
                                             '  File "<distributed cell>", line 3, in <module>\n'
                                             "    raise ValueError('boom')\n"
                                             'ValueError: boom\n'},
                      'kind': 'rank_event',
                      'node_rank': 0,
                      'rank': 1},
                     {'exitcode': None,
                      'kind': 'exit',
                      'node_rank': 0,
                      'rank': 0,
                      'signal': 'SIGTERM',
                      'stopped': True,
                      'timestamp': 1796214462.0132608},
                     {'exitcode': 1,
                      'kind': 'exit',
                      'node_rank': 0,
                      'rank': 1,
                      'signal': None,
                      'stopped': False,
                      'timestamp': 1796214462.0215425},
                     {'elapsed': 0.022572994232177734,
                      'kind': 'finished',
                      'node_rank': 0,
                      'reason': 'failed'}],
 'ok_value': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5089, 1: 5090}, 'supervisor': 5088},
              {'kind': 'output', 'node_rank': 0, 'omitted': 0, 'progress': None, 'rank': 0, 'text': 'hi 0'},
              {'event': {'kind': 'result',
                         'missing': [],
                         'new_modules': [],
                         'returns': {},
                         'timestamp': 1796214461.9526103,
                         'value': {'blob': b'\x80\x05K).', 'type': 'builtins.int'}},
               'kind': 'rank_event',
               'node_rank': 0,
               'rank': 0},
              {'exitcode': 0,
               'kind': 'exit',
               'node_rank': 0,
               'rank': 0,
               'signal': None,
               'stopped': False,
               'timestamp': 1796214461.9538708},
              {'kind': 'output', 'node_rank': 0, 'omitted': 0, 'progress': None, 'rank': 1, 'text': 'hi 1'},
              {'event': {'kind': 'result', 'timestamp': 1796214461.9544938},
               'kind': 'rank_event',
               'node_rank': 0,
               'rank': 1},
              {'exitcode': 0,
               'kind': 'exit',
               'node_rank': 0,
               'rank': 1,
               'signal': None,
               'stopped': False,
               'timestamp': 1796214461.955023},
              {'elapsed': 0.005085468292236328, 'kind': 'finished', 'node_rank': 0, 'reason': None}],
 'rank_left_early': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5121, 1: 5122}, 'supervisor': 5120},
                     {'event': {'exited': True, 'kind': 'result', 'timestamp': 1796214464.7788746},
                      'kind': 'rank_event',
                      'node_rank': 0,
                      'rank': 1},
                     {'exitcode': 0,
                      'kind': 'exit',
                      'node_rank': 0,
                      'rank': 1,
                      'signal': None,
                      'stopped': False,
                      'timestamp': 1796214464.7798219},
                     {'event': {'exc_type': 'RuntimeError',
                                'kind': 'failed',
                                'message': '[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] '
                                           'Connection closed by peer [127.0.0.1]:10895. This is typically '
                                           'caused by a remote worker crashing. Check the logs of the remote '
                                           'worker before reporting an error. GLHF! 🏖️',
                                'new_modules': [],
                                'secondary': True,
                                'timestamp': 1796214464.7931747,
                                'traceback': 'Traceback (most recent call last):\n'
                                             '  File "<distributed cell>", line 5, in <module>\n'
                                             '    dist.barrier()\n'
                                             '  File '
                                             '"/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", '
                                             'line 83, in wrapper\n'
                                             '    return func(*args, **kwargs)\n'
                                             '           ^^^^^^^^^^^^^^^^^^^^^\n'
                                             '  File '
                                             '"/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
                                             'line 5356, in barrier\n'
                                             '    work.wait()\n'
                                             'RuntimeError: '
                                             '[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] '
                                             'Connection closed by peer [127.0.0.1]:10895. This is typically '
                                             'caused by a remote worker crashing. Check the logs of the '
                                             'remote worker before reporting an error. GLHF! 🏖️\n'},
                      'kind': 'rank_event',
                      'node_rank': 0,
                      'rank': 0},
                     {'exitcode': 1,
                      'kind': 'exit',
                      'node_rank': 0,
                      'rank': 0,
                      'signal': None,
                      'stopped': False,
                      'timestamp': 1796214464.803478},
                     {'elapsed': 0.0357663631439209, 'kind': 'finished', 'node_rank': 0, 'reason': 'failed'}],
 'restart_attempt_0': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5111, 1: 5112}, 'supervisor': 5110},
                       {'event': {'kind': 'result',
                                  'missing': [],
                                  'new_modules': [],
                                  'returns': {},
                                  'timestamp': 1796214464.606501,
                                  'value': {'blob': b'\x80\x05\x95\x08\x00\x00\x00\x00\x00\x00\x00\x8c\x04don'
                                                    b'e\x94.',
                                            'type': 'builtins.str'}},
                        'kind': 'rank_event',
                        'node_rank': 0,
                        'rank': 0},
                       {'exitcode': 0,
                        'kind': 'exit',
                        'node_rank': 0,
                        'rank': 0,
                        'signal': None,
                        'stopped': False,
                        'timestamp': 1796214464.6076841},
                       {'event': {'exc_type': 'RuntimeError',
                                  'kind': 'failed',
                                  'message': 'flaky',
                                  'secondary': False,
                                  'timestamp': 1796214464.6090226,
                                  'traceback': 'Traceback (most recent call last):\n'
                                               '  File "<distributed cell>", line 3, in <module>\n'
                                               "    raise RuntimeError('flaky')\n"
                                               'RuntimeError: flaky\n'},
                        'kind': 'rank_event',
                        'node_rank': 0,
                        'rank': 1},
                       {'exitcode': 1,
                        'kind': 'exit',
                        'node_rank': 0,
                        'rank': 1,
                        'signal': None,
                        'stopped': False,
                        'timestamp': 1796214464.6176896},
                       {'elapsed': 0.01424407958984375,
                        'kind': 'finished',
                        'node_rank': 0,
                        'reason': 'failed'}],
 'restart_attempt_1': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5116, 1: 5117}, 'supervisor': 5115},
                       {'event': {'kind': 'result', 'timestamp': 1796214464.7150285},
                        'kind': 'rank_event',
                        'node_rank': 0,
                        'rank': 1},
                       {'exitcode': 0,
                        'kind': 'exit',
                        'node_rank': 0,
                        'rank': 1,
                        'signal': None,
                        'stopped': False,
                        'timestamp': 1796214464.7158213},
                       {'event': {'kind': 'result',
                                  'missing': [],
                                  'new_modules': [],
                                  'returns': {},
                                  'timestamp': 1796214464.715055,
                                  'value': {'blob': b'\x80\x05\x95\x08\x00\x00\x00\x00\x00\x00\x00\x8c\x04don'
                                                    b'e\x94.',
                                            'type': 'builtins.str'}},
                        'kind': 'rank_event',
                        'node_rank': 0,
                        'rank': 0},
                       {'exitcode': 0,
                        'kind': 'exit',
                        'node_rank': 0,
                        'rank': 0,
                        'signal': None,
                        'stopped': False,
                        'timestamp': 1796214464.7161868},
                       {'elapsed': 0.003895998001098633, 'kind': 'finished', 'node_rank': 0, 'reason': None}],
 'sigkill_rank1': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5099, 1: 5100}, 'supervisor': 5098},
                   {'exitcode': None,
                    'kind': 'exit',
                    'node_rank': 0,
                    'rank': 1,
                    'signal': 'SIGKILL',
                    'stopped': False,
                    'timestamp': 1796214462.1347883},
                   {'exitcode': None,
                    'kind': 'exit',
                    'node_rank': 0,
                    'rank': 0,
                    'signal': 'SIGTERM',
                    'stopped': True,
                    'timestamp': 1796214462.1442695},
                   {'elapsed': 0.022994279861450195, 'kind': 'finished', 'node_rank': 0, 'reason': 'failed'}],
 'timeout': [{'kind': 'started', 'node_rank': 0, 'pids': {0: 5104, 1: 5105}, 'supervisor': 5103},
             {'kind': 'stacks',
              'native': True,
              'node_rank': 0,
              'rank': 0,
              'text': 'Thread 5104 (idle): "MainThread"\n'
                      '    clock_nanosleep (libc.so.6)\n'
                      '    time_sleep (libpython3.11.so.1.0)\n'
                      '    <module> (<distributed cell>:2)\n'
                      '    0x7fbb3984524a (libc.so.6)\n'},
             {'exitcode': None,
              'kind': 'exit',
              'node_rank': 0,
              'rank': 0,
              'signal': 'SIGTERM',
              'stopped': True,
              'timestamp': 1796214464.5079386},
             {'kind': 'stacks',
              'native': True,
              'node_rank': 0,
              'rank': 1,
              'text': 'Thread 5105 (idle): "MainThread"\n'
                      '    clock_nanosleep (libc.so.6)\n'
                      '    time_sleep (libpython3.11.so.1.0)\n'
                      '    <module> (<distributed cell>:2)\n'
                      '    0x7fbb3984524a (libc.so.6)\n'},
             {'exitcode': None,
              'kind': 'exit',
              'node_rank': 0,
              'rank': 1,
              'signal': 'SIGTERM',
              'stopped': True,
              'timestamp': 1796214464.5091765},
             {'elapsed': 2.2770326137542725, 'kind': 'finished', 'node_rank': 0, 'reason': 'timeout'}]}

# Every node of a Slurm allocation, as SlurmRun merges the nodes' messages:
# rank 3 on node n2 fails right after init_process_group while the ranks of
# n1 wait in a collective (their gloo errors are consequences, and come later).
_NODES = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
SLURM_REMOTE_RANK_FAILS = [
    {"kind": "started", "pids": {0: 11, 1: 12, 2: 21, 3: 22}, "nodes": _NODES, "master_addr": "10.0.0.1"},
    {"kind": "output", "rank": 2, "text": "up", "omitted": 0, "progress": None, "node": 1},
    {"kind": "rank_event", "rank": 3, "node": 1, "event": {
        "kind": "failed", "exc_type": "RuntimeError", "message": "node 2 broke", "secondary": False,
        "timestamp": 100.0, "traceback": "Traceback (most recent call last):\nRuntimeError: node 2 broke\n"}},
    {"kind": "exit", "rank": 3, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 100.01, "node": 1},
    {"kind": "exit", "rank": 2, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 100.2,
     "node": 1},
    {"kind": "rank_event", "rank": 0, "node": 0, "event": {
        "kind": "failed", "exc_type": "RuntimeError", "message": "Connection closed by peer [10.0.0.2]:4242",
        "secondary": True, "timestamp": 100.5, "traceback": "..."}},
    {"kind": "exit", "rank": 0, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 100.6, "node": 0},
    {"kind": "exit", "rank": 1, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 100.6,
     "node": 0},
    {"kind": "finished", "reason": "failed", "forced": None, "terminated_on": []},
]

# Node n2's rank 3 ends with os._exit(3) after init_process_group: no exception of its own.
SLURM_REMOTE_RANK_EXITS = [
    {"kind": "started", "pids": {0: 11, 1: 12, 2: 21, 3: 22}, "nodes": _NODES, "master_addr": "10.0.0.1"},
    {"kind": "exit", "rank": 3, "exitcode": 3, "signal": None, "stopped": False, "timestamp": 50.0, "node": 1},
    {"kind": "rank_event", "rank": 0, "node": 0, "event": {
        "kind": "failed", "exc_type": "RuntimeError", "message": "Connection reset by peer", "secondary": True,
        "timestamp": 49.9, "traceback": "..."}},
    {"kind": "exit", "rank": 0, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 50.1, "node": 0},
    {"kind": "exit", "rank": 1, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 50.2,
     "node": 0},
    {"kind": "exit", "rank": 2, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 50.2,
     "node": 1},
    {"kind": "finished", "reason": "failed", "forced": None, "terminated_on": []},
]

# The stop button on a Slurm run: every node's stacks, then every rank stopped.
SLURM_INTERRUPTED = [
    {"kind": "started", "pids": {0: 11, 1: 12, 2: 21, 3: 22}, "nodes": _NODES, "master_addr": "10.0.0.1"},
    *[{"kind": "stacks", "rank": r, "text": f"File \"<cell>\", line 2, in stuck_{r}", "native": False}
      for r in range(4)],
    *[{"kind": "exit", "rank": r, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 9.0}
      for r in range(4)],
    {"kind": "finished", "reason": "interrupt", "forced": None, "terminated_on": []},
]

# A session cell: rank 0 binds a name, the ranks stay at their prompt.
SESSION_CELL_OK = [
    {"kind": "rank_event", "rank": 0, "event": {"kind": "names", "assigned": ["model", "tmp"], "deleted": ["tmp"]}},
    {"kind": "rank_event", "rank": 1, "event": {"kind": "names", "assigned": ["model"], "deleted": []}},
    {"kind": "output", "rank": 1, "text": "step 1", "omitted": 0, "progress": None},
    {"kind": "rank_event", "rank": 0, "event": {"kind": "result", "timestamp": 5.0, "missing": [], "returns": {},
                                                "new_modules": []}},
    {"kind": "rank_event", "rank": 1, "event": {"kind": "result", "timestamp": 5.0}},
    {"kind": "finished", "reason": None, "session": "alive", "elapsed": 0.01},
]

# A session whose rank died in a cell: the session is gone.
SESSION_CELL_LOST = [
    {"kind": "exit", "rank": 1, "exitcode": None, "signal": "SIGKILL", "stopped": False, "timestamp": 7.0},
    {"kind": "exit", "rank": 0, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 7.1},
    {"kind": "finished", "reason": "failed", "session": "lost", "lost": "rank 1 died (SIGKILL)"},
]

# Rank 2 (node n2) finishes the cell with sys.exit(0) before init_process_group;
# ranks 0, 1 (n1) and 3 (n2) are in init_process_group waiting for it
# ("joining", from the rank's guard of init_process_group).  The kernel stops
# the run at the last of these (fold.must_stop); the interrupt follows.
SLURM_LEFT_BEFORE_INIT = [
    {"kind": "started", "pids": {0: 11, 1: 12, 2: 21, 3: 22}, "nodes": _NODES, "master_addr": "10.0.0.1"},
    {"kind": "rank_event", "rank": 0, "node": 0, "event": {"kind": "joining"}},
    {"kind": "rank_event", "rank": 1, "node": 0, "event": {"kind": "joining"}},
    {"kind": "rank_event", "rank": 3, "node": 1, "event": {"kind": "joining"}},
    {"kind": "rank_event", "rank": 2, "node": 1, "event": {"kind": "result", "exited": True, "in_world": False,
                                                           "timestamp": 30.0}},
    {"kind": "exit", "rank": 2, "exitcode": 0, "signal": None, "stopped": False, "timestamp": 30.1, "node": 1},
]
SLURM_LEFT_BEFORE_INIT_STOPPED = [
    *[{"kind": "stacks", "rank": r, "native": False, "text":
       f"File \"<cell>\", line 5, in <module>\n  dist.init_process_group('gloo')"} for r in (0, 1, 3)],
    *[{"kind": "exit", "rank": r, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 31.0}
      for r in (0, 1, 3)],
    {"kind": "finished", "reason": "interrupt", "forced": None, "terminated_on": []},
]

# Rank 2 (node n2) ends with os._exit(0) right after init_process_group while the
# others wait in a barrier: their gloo errors (consequences) come before its exit
# is reaped and reported.
SLURM_EXIT_0_AFTER_INIT = [
    {"kind": "started", "pids": {0: 11, 1: 12, 2: 21, 3: 22}, "nodes": _NODES, "master_addr": "10.0.0.1"},
    *[{"kind": "rank_event", "rank": r, "node": r // 2, "event": {"kind": k}} for k in ("joining", "joined")
      for r in range(4)],
    {"kind": "rank_event", "rank": 1, "node": 0, "event": {
        "kind": "failed", "exc_type": "RuntimeError", "message": "Connection closed by peer [127.0.0.1]:6044",
        "secondary": True, "timestamp": 40.0, "traceback": "..."}},
    {"kind": "exit", "rank": 1, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 40.1, "node": 0},
    {"kind": "exit", "rank": 2, "exitcode": 0, "signal": None, "stopped": False, "timestamp": 40.2, "node": 1},
    {"kind": "exit", "rank": 0, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 40.3,
     "node": 0},
    {"kind": "exit", "rank": 3, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 40.3,
     "node": 1},
    {"kind": "finished", "reason": "failed", "forced": None, "terminated_on": []},
]
