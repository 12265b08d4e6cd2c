"""The kernel's channel to the node agents, without a cluster: real ZMQ
sockets (a ROUTER as the kernel's, DEALERs as the agents'), the real signing.

A cell goes to every node in one message signed once (the payload pickled
and HMAC'd once, not once per node); each agent verifies it with its own
replay history, and an agent that is gone is reported while the others
still get it."""
from __future__ import annotations

import pytest
import zmq

from accel_magics.kernel_ext import wire
from accel_magics.kernel_ext.kernel.slurm import SlurmAgents

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def channel(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2,n3")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    agents = SlurmAgents(3)
    agents.key, agents.ident = wire.new_key(), "kernel-side"
    agents.session = wire.signed_session(agents.key)
    ctx = zmq.Context()
    agents.sock = ctx.socket(zmq.ROUTER)
    agents.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    address = f"ipc://{tmp_path}/agents"
    agents.sock.bind(address)
    dealers = {}
    for node in (0, 1):   # node 2's agent never connects: it is gone
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, f"kernel-side-{node}".encode())
        d.connect(address)
        d.send(b"hello")
        dealers[node] = d
    for _ in dealers:   # the ROUTER knows a peer once it has heard from it
        assert agents.sock.poll(10_000)
        agents.sock.recv_multipart()
    yield agents, dealers
    for s in (agents.sock, *dealers.values()):
        s.close(linger=0)
    ctx.term()


def test_one_message_signed_once_reaches_every_agent_and_a_gone_one_is_named(channel):
    agents, dealers = channel
    payload = b"\x00" * (1 << 20)   # over zmq's copy threshold: sent without a copy per node
    content = {"op": "run", "run_id": "r1", "cfgs": {0: {"node_rank": 0}, 1: {"node_rank": 1}, 2: {"node_rank": 2}},
               "payload": payload}
    gone = agents.send_all([0, 1, 2], content)
    assert list(gone) == [2] and isinstance(gone[2], zmq.ZMQError)
    received = {}
    for node, d in dealers.items():
        assert d.poll(10_000)
        frames = d.recv_multipart()
        # Each agent checks it with its own session (its own replay history).
        verifier = wire.signed_session(agents.key)
        got = wire.verified_content(verifier, frames)
        assert got["cfgs"][node] == {"node_rank": node} and got["payload"] == payload
        with pytest.raises(ValueError, match="duplicate"):   # a replay to the same agent is refused
            wire.verified_content(verifier, frames)
        received[node] = frames
    # Signed once: every agent got the very same frames (one header, one signature).
    assert received[0] == received[1]


def test_a_message_not_signed_with_the_key_is_refused_by_an_agent(channel):
    agents, dealers = channel
    agents.session = wire.signed_session(wire.new_key())   # not the allocation's key
    assert agents.send_all([0], {"op": "ping"}) == {}
    assert dealers[0].poll(10_000)
    with pytest.raises(ValueError, match="invalid signature"):
        wire.verified_content(wire.signed_session(agents.key), dealers[0].recv_multipart())


def test_a_nodes_messages_go_as_one_batch_verified_once_and_come_out_as_they_were(tmp_path):
    """A node's supervisor sends what it holds as one signed message
    (wire.messages.batch), its frames packed into one (wire.packed); the
    kernel verifies it once and passes the messages inside on in order, each
    as it was; a batch not signed with the run's key, or a frame that is no
    packed message, is never unpickled."""
    from accel_magics.kernel_ext.kernel.run_handle import receive_verified
    from accel_magics.kernel_ext.wire.messages import Kind, batch, unbatched

    key = wire.new_key()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind(f"ipc://{tmp_path}/events")
        push.connect(f"ipc://{tmp_path}/events")
        said = [{"kind": "started", "pids": {0: 11}}, {"kind": "released"},
                {"kind": "rank_event", "rank": 0, "event": {"kind": "result", "value": None}},
                {"kind": "exit", "rank": 0, "exitcode": 0, "signal": None, "stopped": False},
                {"kind": "finished", "reason": None, "elapsed": 0.01}]
        for m in said:
            m.update(run_id="r1", node_rank=3)
        one = batch(said)
        assert one["kind"] == Kind.BATCH and one["run_id"] == "r1" and one["node_rank"] == 3
        assert batch(said[:1]) is said[0]   # a single message goes as it is
        wire.signed_session(wire.new_key()).send(push, "run_event", one)   # not the run's key
        push.send(b"\x05\x00\x00\x00\x00\x00\x00\x00abc")   # a frame that is no packed message
        signer = wire.signed_session(key)
        # As a node's supervisor sends it: the small message's frames packed into one.
        packed = wire.packed(signer.serialize(signer.msg("run_event", one)))
        assert len(packed) == 1
        push.send_multipart(packed)
        signer.send(push, "run_event", said[0])   # frames as they are: taken too
        reader = wire.signed_session(key)
        assert pull.poll(10_000)
        got, dropped = receive_verified(pull, reader, "r1")
        while got is None:   # both sent: wait for the second to arrive
            assert pull.poll(10_000)
            got, more = receive_verified(pull, reader, "r1")
            dropped += more
        assert dropped == 2   # the one signed with another key, the malformed one: never unpickled
        assert unbatched(got) == said
        assert pull.poll(10_000)
        single, _ = receive_verified(pull, reader, "r1")
        assert unbatched(single) == [said[0]]
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
