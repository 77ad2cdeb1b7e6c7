#!/usr/bin/env python3
"""nats-server's CPU per message under each way the relay could publish (issue 23's groundwork).

Usage: nats_publish_cost.py NATS_SERVER_BIN [N=100000] [MODES=relay,nofence,minhdr,fast,atomic]
(`relay:M`, `nofence:M`, `minhdr:M`: the same with reply subjects cycling through M values)

Starts its own `nats-server -js` on a free loopback port, creates one file-storage stream per
mode, publishes N messages of the relay's shape (~100-byte payload) over one raw connection with
at most 2 000 unacknowledged, and prints the server's CPU (utime + stime from /proc) per message:
- relay:   the relay's frame today: Nats-Msg-Id, the strict-mode fence (Nats-Expected-Last-Sequence,
           Nats-Expected-Last-Msg-Id), nine Outbox-* headers, an ack per message;
- nofence: the same without the fence's two headers;
- minhdr:  Nats-Msg-Id and one position header;
- fast:    fast-ingest batch (2.14+, the stream's allow_batched; the batch's parameters in the
           reply subject, a flow-control ack every 500), the relay's headers without the fence;
- fastseq: fast-ingest batches of 1 000 (fastseqK: of K), each committed by its last message, every
           message with the relay's headers and Nats-Expected-Last-Sequence (no id chain): what a
           fast publish mode that keeps strict mode's sequence fence sends;
- atomic:  atomic batches of 1 000 (2.12+, allow_atomic; Nats-Batch-Id/-Sequence/-Commit), the
           relay's headers without the fence, a reply on each commit only; atomicK: batches of K
           (e.g. atomic10: the line also gives the CPU per batch, the server's fixed cost of one).
A mode may carry tags after a `+`, settings of its stream: `+async` (persist_mode async, 2.12+:
acknowledged before written, so not durable against a server kill; for reference), `+dw1s` (a 1 s
duplicate window instead of 2 min), e.g. `fastseq+async`.
A measurement tool, not a client: no reconnects, no checks beyond counting what was stored."""
import json, os, socket, subprocess, sys, tempfile, threading, time, uuid

BIN = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 100000
MODES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["relay", "nofence", "minhdr", "fast", "atomic"]
PAYLOAD = b'{"order_id":"order-12345","amount_cents":1999,"currency":"EUR","note":"' + b"x" * 40 + b'"}'
TICK = os.sysconf("SC_CLK_TCK")

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK

class Conn:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port)); self.buf = b""
        self.line()  # INFO
        self.s.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true,"protocol":1}\r\nSUB _I.> 1\r\nPING\r\n')
        while True:
            l = self.line()
            if l.startswith(b"PONG"): break
            if l.startswith(b"INFO"): continue
            raise SystemExit(l)
    def line(self):
        while b"\r\n" not in self.buf:
            d = self.s.recv(1 << 16)
            if not d: raise SystemExit("closed")
            self.buf += d
        l, self.buf = self.buf.split(b"\r\n", 1); return l
    def msg(self):
        """Next MSG/HMSG: (subject, payload); answers PINGs."""
        while True:
            l = self.line()
            if l.startswith(b"PING"): self.s.sendall(b"PONG\r\n"); continue
            if l.startswith(b"MSG") or l.startswith(b"HMSG"):
                parts = l.split(); size = int(parts[-1])
                while len(self.buf) < size + 2:
                    self.buf += self.s.recv(1 << 16)
                body, self.buf = self.buf[:size], self.buf[size + 2:]
                if l.startswith(b"HMSG"):
                    body = body[int(parts[-2]):]
                return parts[1], body
            if l.startswith(b"-ERR"): raise SystemExit(l)
    def request(self, subject, body):
        self.s.sendall(b"PUB %s _I.req %d\r\n%s\r\n" % (subject.encode(), len(body), body))
        return json.loads(self.msg()[1])

def headers(i, mode, extra=()):
    h = [(b"Nats-Msg-Id", b"OrderPaid:order-%d:%d" % (i % 977, i))]
    if mode in ("relay", "seqfence"):
        h += [(b"Nats-Expected-Last-Sequence", b"%d" % (i - 1))]
    if mode == "relay":
        if i > 1: h += [(b"Nats-Expected-Last-Msg-Id", b"OrderPaid:order-%d:%d" % ((i - 1) % 977, i - 1))]
    if mode != "minhdr":
        h += [(b"Outbox-Id", b"%d" % i), (b"Outbox-Entity-Id", b"order-%d" % (i % 977)), (b"Outbox-Event-Type", b"OrderPaid"),
              (b"Outbox-Partition-Key", b"order-%d" % (i % 977)), (b"Outbox-Ordering-Key", b"1764633600000:%020d" % i),
              (b"Outbox-Shard", b"7"), (b"Outbox-Commit-Lsn", b"0/%X" % (0x1000000 + i * 100)), (b"Outbox-Tx-Index", b"%d" % (i % 1000)),
              (b"Outbox-Source", b"7312345678901234567.1.5.slot_x")]
    else:
        h += [(b"Outbox-Position", b"0/%X:%d" % (0x1000000 + i * 100, i % 1000))]
    h += list(extra)
    return b"NATS/1.0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in h) + b"\r\n"

def frame(subject, reply, hdr):
    total = len(hdr) + len(PAYLOAD)
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject, reply, len(hdr), total, hdr, PAYLOAD)

def run(port, pid, mode):
    label = mode; tags = mode.split("+"); mode = tags[0]
    base, _, cycle = mode.partition(":"); cycle = int(cycle or 0)
    if cycle and base not in ("relay", "nofence", "minhdr"): raise SystemExit(f"{mode}: a cycle of reply subjects is for relay, nofence and minhdr")
    c = Conn(port); name = "S_" + mode.upper().replace(":", "_")
    cfg = {"name": name, "subjects": [f"{name}.>"], "storage": "file", "duplicate_window": 120_000_000_000}
    if mode == "fast" or mode.startswith("fastseq"): cfg["allow_batched"] = True
    if "async" in tags: cfg["persist_mode"] = "async"
    if "dw1s" in tags: cfg["duplicate_window"] = 1_000_000_000
    if tags[1:]:
        name += "_" + "_".join(tags[1:]).upper(); cfg.update(name=name, subjects=[f"{name}.>"])
    fastseq = int(mode[7:] or 1000) if mode.startswith("fastseq") else 0
    batch = int(mode[6:] or 1000) if mode.startswith("atomic") else 0
    if batch: cfg["allow_atomic"] = True
    r = c.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(cfg).encode())
    if "error" in r: raise SystemExit(f"{mode}: {r['error']}")
    subject = f"{name}.7.OrderPaid".encode()
    frames = []
    bid = uuid.uuid4().hex[:22]
    for i in range(1, N + 1):
        if mode == "fast":
            op = 0 if i == 1 else (2 if i == N else 1)
            frames.append(frame(subject, b"_I.%s.500.fail.%d.%d.$FI" % (bid.encode(), i, op), headers(i, mode)))
        elif fastseq:
            b, k = (i - 1) // fastseq, (i - 1) % fastseq + 1
            op = 0 if k == 1 else (2 if k == fastseq or i == N else 1)
            frames.append(frame(subject, b"_I.%s-%d.%d.fail.%d.%d.$FI" % (bid.encode(), b, min(fastseq, 500), k, op), headers(i, "seqfence")))
        elif batch:
            b, k = (i - 1) // batch, (i - 1) % batch + 1
            last = k == batch or i == N
            extra = [(b"Nats-Batch-Id", b"%s-%d" % (bid.encode(), b)), (b"Nats-Batch-Sequence", b"%d" % k)]
            if last: extra.append((b"Nats-Batch-Commit", b"1"))
            frames.append(frame(subject, b"_I.%d" % i if last else b"", headers(i, "nofence", extra)).replace(b"  ", b" "))
        else:
            # `mode:M`: the reply subjects cycle through M values (the server's subject cache
            # then hits) instead of one per message.
            reply = b"_I.%d" % (i % cycle if cycle else i)
            frames.append(frame(subject, reply, headers(i, base)))
    done = [0]; errors = []
    cv = threading.Condition()
    def reader():
        while done[0] < N:
            _, body = c.msg()
            a = json.loads(body)
            if "error" in a: errors.append(a); 
            with cv:
                if fastseq:
                    if "batch" in a and "count" in a: done[0] += a["count"]
                elif mode == "fast":
                    done[0] = max(done[0], a.get("seq", 0) if "seq" in a else (a.get("count", 0) if "batch" in a else done[0]))
                    if "batch" in a and "count" in a: done[0] = N
                elif batch:
                    done[0] = done[0] + a.get("count", batch) if "count" in a else done[0] + batch
                else:
                    done[0] += 1
                cv.notify_all()
    t = threading.Thread(target=reader, daemon=True)
    window = 2000
    before = cpu(pid); start = time.time()
    t.start()
    sent = 0
    while sent < N:
        with cv:
            while sent - done[0] >= window: cv.wait(5)
        chunk = frames[sent:sent + 250]; c.s.sendall(b"".join(chunk)); sent += len(chunk)
    t.join(120)
    elapsed = time.time() - start; after = cpu(pid)
    info = c.request(f"$JS.API.STREAM.INFO.{name}", b"")
    stored = info.get("state", {}).get("messages")
    per_batch = f"  {1e3 * (after - before) / N * batch:5.2f} ms/batch" if batch else ""
    print(f"{label:16} stored {stored}/{N}  server CPU {1e6 * (after - before) / N:6.2f} us/msg{per_batch}  {N / elapsed:8.0f} msg/s  errors {len(errors)} {errors[:1]}", flush=True)

d = tempfile.mkdtemp(); port = free_port()
srv = subprocess.Popen([BIN, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.5)
for _ in range(50):
    try: socket.create_connection(("127.0.0.1", port)).close(); break
    except OSError: time.sleep(0.1)
try:
    for m in MODES: run(port, srv.pid, m)
finally:
    srv.kill()
