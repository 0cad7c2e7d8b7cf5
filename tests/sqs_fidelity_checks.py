"""The checks of the SQS fidelity probe (``tests/sqs_fidelity.py``), one function per row.

Each states what AWS documents (the API reference in botocore's service model, the SQS
developer guide) and returns what the server did. Real-time waits appear only where a
visibility timeout or a long poll is the thing under test, and last 1-2 s.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

from tests.sqs_fidelity import (
    OPEN,
    SHORT_VISIBILITY,
    Outcome,
    Probe,
    Reply,
    check,
    judged,
)

# AWS's limits, from its API reference (botocore's bundled model, 2026).
MAX_VISIBILITY = 43_200  # 12 hours
MAX_WAIT = 20  # seconds of long polling
MAX_BATCH = 10
MAX_ATTRIBUTES = 10
OLD_BODY_LIMIT = 262_144  # 256 KiB, the limit until August 2025
BODY_LIMIT = 1_048_576  # 1 MiB: the maximum and the default MaximumMessageSize today
# How much later than its timeout a message may reappear before the probe says "late".
VISIBILITY_SLACK = 1.0


def _md5_of_attributes(attributes: dict[str, dict[str, Any]]) -> str:
    """AWS's MD5OfMessageAttributes: per attribute, sorted by name, length-prefixed (4 bytes,
    big-endian) name, type and value, with a transport byte 1 (string) or 2 (binary)."""
    digest = hashlib.md5()
    for name in sorted(attributes):
        value = attributes[name]
        for part in (name.encode(), value["DataType"].encode()):
            digest.update(len(part).to_bytes(4, "big") + part)
        if "BinaryValue" in value:
            raw, transport = bytes(value["BinaryValue"]), b"\x02"
        else:
            raw, transport = str(value["StringValue"]).encode(), b"\x01"
        digest.update(transport + len(raw).to_bytes(4, "big") + raw)
    return digest.hexdigest()


def _send(probe: Probe, url: str, body: str = "m", **params: Any) -> Reply:
    return probe.call("send_message", QueueUrl=url, MessageBody=body, **params)


@check("visibility timeout expires",
       "a received message is hidden for its visibility timeout, then received again")
def visibility_expiry(probe: Probe) -> Outcome:
    url = probe.queue(VisibilityTimeout=SHORT_VISIBILITY)
    _send(probe, url)
    [_first] = probe.receive(url)
    hidden = probe.receive(url, WaitTimeSeconds=0)
    again, after = probe.receive_until(url, within=SHORT_VISIBILITY + 5)
    on_time = bool(again) and after <= SHORT_VISIBILITY + VISIBILITY_SLACK
    return judged(not hidden and on_time,
                  f"hidden at once: {not hidden}; back after {after:.2f}s "
                  f"(timeout {SHORT_VISIBILITY}s)" if again else "never came back")


@check("ChangeMessageVisibility extends",
       "the new timeout counts from the call; the message stays hidden; 0 makes it visible")
def visibility_extension(probe: Probe) -> Outcome:
    url = probe.queue(VisibilityTimeout=SHORT_VISIBILITY)
    _send(probe, url)
    [message] = probe.receive(url)
    extended = probe.call("change_message_visibility", QueueUrl=url,
                          ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=30)
    late, waited = probe.receive_until(url, within=SHORT_VISIBILITY + VISIBILITY_SLACK)
    shown = probe.call("change_message_visibility", QueueUrl=url,
                       ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0)
    back = probe.receive(url, WaitTimeSeconds=0)
    return judged(extended.ok and not late and shown.ok and bool(back),
                  f"extend: {extended}; still hidden {waited:.1f}s later: {not late}; "
                  f"timeout 0: {shown}, received at once: {bool(back)}")


@check("12-hour cap",
       f"VisibilityTimeout > {MAX_VISIBILITY} is refused (queue, receive, change); a change "
       "past 12 h from the receive is refused")
def twelve_hours(probe: Probe) -> Outcome:
    over = MAX_VISIBILITY + 1
    queue_over = probe.call("create_queue", QueueName=f"probe-{probe.run_id}-cap",
                            Attributes={"VisibilityTimeout": str(over)})
    url = probe.queue()
    _send(probe, url)
    receive_over = probe.call("receive_message", QueueUrl=url, VisibilityTimeout=over)
    for taken in receive_over.response.get("Messages", []) if receive_over.ok else []:
        # accepted: make it visible again, to receive it as the rest of the check expects
        probe.call("change_message_visibility", QueueUrl=url,
                   ReceiptHandle=taken["ReceiptHandle"], VisibilityTimeout=0)
    [message] = probe.receive(url)
    handle = message["ReceiptHandle"]
    change_over = probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=handle,
                             VisibilityTimeout=over)
    time.sleep(1.1)  # the thing under test: the cap counts from the receive
    full = probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=handle,
                      VisibilityTimeout=MAX_VISIBILITY)
    within = probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=handle,
                        VisibilityTimeout=MAX_VISIBILITY - 100)
    refused = not queue_over.ok and not receive_over.ok and not change_over.ok
    return judged(refused and not full.ok and within.ok,
                  f"{over}s: CreateQueue {queue_over}, ReceiveMessage {receive_over}, "
                  f"ChangeMessageVisibility {change_over}; 1 s after the receive, "
                  f"{MAX_VISIBILITY}s: {full}, {MAX_VISIBILITY - 100}s: {within}")


@check("ApproximateReceiveCount",
       "1 on the first receive, +1 per receive; ApproximateFirstReceiveTimestamp kept")
def receive_count(probe: Probe) -> Outcome:
    url = probe.queue()
    _send(probe, url)
    counts, first_stamps = [], set()
    for _ in range(3):
        [message] = probe.receive(url)
        counts.append(int(message["Attributes"]["ApproximateReceiveCount"]))
        first_stamps.add(message["Attributes"].get("ApproximateFirstReceiveTimestamp"))
        probe.call("change_message_visibility", QueueUrl=url,
                   ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0)
    return judged(counts == [1, 2, 3] and len(first_stamps) == 1 and None not in first_stamps,
                  f"counts {counts}; first-receive timestamps {len(first_stamps)} distinct")


@check("stale receipt handle",
       "after a new receive: ChangeMessageVisibility with the old handle fails; DeleteMessage "
       "with it succeeds (the message may or may not be deleted)")
def stale_handle(probe: Probe) -> Outcome:
    url = probe.queue()
    _send(probe, url)
    [first] = probe.receive(url)
    probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=first["ReceiptHandle"],
               VisibilityTimeout=0)
    [second] = probe.receive(url)
    same = first["ReceiptHandle"] == second["ReceiptHandle"]
    old = first["ReceiptHandle"]
    change = probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=old,
                        VisibilityTimeout=30)
    delete = probe.call("delete_message", QueueUrl=url, ReceiptHandle=old)
    current = probe.call("change_message_visibility", QueueUrl=url,
                         ReceiptHandle=second["ReceiptHandle"], VisibilityTimeout=0)
    remaining = probe.receive(url, WaitTimeSeconds=0)
    deleted = not remaining
    return judged(not same and not change.ok and delete.ok,
                  f"new handle per receive: {not same}; ChangeMessageVisibility(old): "
                  f"{change}; DeleteMessage(old): {delete}, message "
                  f"{'deleted' if deleted else 'kept'}; then the current handle: {current}")


@check("handle of a lapsed, not re-received message",
       "undocumented (MessageNotInflight is listed for ChangeMessageVisibility)")
def lapsed_handle(probe: Probe) -> Outcome:
    url = probe.queue(VisibilityTimeout=SHORT_VISIBILITY)
    _send(probe, url)
    [message] = probe.receive(url)
    give_up = time.monotonic() + SHORT_VISIBILITY + 5
    while probe.counts(url) != (1, 0) and time.monotonic() < give_up:
        time.sleep(0.05)  # polling until its timeout passed, with a deadline
    change = probe.call("change_message_visibility", QueueUrl=url,
                        ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=30)
    hidden_again = probe.counts(url) == (0, 1)
    delete = probe.call("delete_message", QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    return Outcome(OPEN, f"ChangeMessageVisibility: {change} (hidden again: {hidden_again}); "
                         f"DeleteMessage: {delete}, queue then {probe.counts(url)}")


@check("deleting twice, changing a deleted message",
       "DeleteMessage with a used (old) handle succeeds; ChangeMessageVisibility of a "
       "deleted message fails; a malformed handle: ReceiptHandleIsInvalid")
def deleted_handle(probe: Probe) -> Outcome:
    url = probe.queue()
    _send(probe, url)
    [message] = probe.receive(url)
    handle = message["ReceiptHandle"]
    first = probe.call("delete_message", QueueUrl=url, ReceiptHandle=handle)
    again = probe.call("delete_message", QueueUrl=url, ReceiptHandle=handle)
    change = probe.call("change_message_visibility", QueueUrl=url, ReceiptHandle=handle,
                        VisibilityTimeout=10)
    bogus = probe.call("delete_message", QueueUrl=url, ReceiptHandle="not-a-handle")
    return judged(first.ok and again.ok and not change.ok
                  and bogus.refused_with("ReceiptHandleIsInvalid"),
                  f"delete: {first}, again: {again}; change after delete: {change}; "
                  f"a malformed handle: {bogus}")


@check("error codes as botocore sees them",
       "JSON protocol, query-compatible: botocore raises the modeled exception; Error.Code "
       "is the legacy query code (x-amzn-query-error), e.g. "
       "AWS.SimpleQueueService.NonExistentQueue, and Error.QueryErrorCode the shape name")
def error_codes(probe: Probe) -> Outcome:
    url = probe.queue()
    missing = probe.call("get_queue_attributes", QueueUrl=url + "-missing",
                         AttributeNames=["All"])
    legacy = missing.code == "AWS.SimpleQueueService.NonExistentQueue"
    return judged(missing.exception == "QueueDoesNotExist" and legacy,
                  f"a missing queue raises {missing.exception}, Error.Code {missing.code!r}, "
                  f"QueryErrorCode "
                  f"{missing.response.get('Error', {}).get('QueryErrorCode')!r}")


@check("FIFO group blocking",
       "while a group's message is in flight, no later message of that group is delivered; "
       "other groups are")
def fifo_groups(probe: Probe) -> Outcome:
    url = probe.queue(fifo=True)
    for body, group in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        _send(probe, url, body, MessageGroupId=group, MessageDeduplicationId=body)
    [first] = probe.receive(url, count=1)
    during = [m["Body"] for m in probe.receive(url)]
    probe.call("delete_message", QueueUrl=url, ReceiptHandle=first["ReceiptHandle"])
    after = [m["Body"] for m in probe.receive(url)]
    return judged(first["Body"] == "a1" and during == ["b1"] and after == ["a2"],
                  f"first {first['Body']}; while a1 in flight: {during}; after deleting a1: "
                  f"{after}")


@check("FIFO deduplication",
       "a MessageDeduplicationId sent again within 5 min is accepted but not delivered, "
       "also after the first copy was deleted")
def fifo_dedup(probe: Probe) -> Outcome:
    url = probe.queue(fifo=True)
    first = _send(probe, url, "x", MessageGroupId="g", MessageDeduplicationId="d1")
    again = _send(probe, url, "x", MessageGroupId="g", MessageDeduplicationId="d1")
    delivered = probe.receive(url)
    for message in delivered:
        probe.call("delete_message", QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    after_delete = _send(probe, url, "x", MessageGroupId="g", MessageDeduplicationId="d1")
    redelivered = probe.receive(url, WaitTimeSeconds=0)
    same_id = first.ok and again.ok and first.response["MessageId"] == again.response[
        "MessageId"]
    sequence = "SequenceNumber" in first.response
    return judged(first.ok and again.ok and after_delete.ok and len(delivered) == 1
                  and not redelivered,
                  f"resend: {again} (same MessageId: {same_id}); delivered {len(delivered)}; "
                  f"resend after delete: {after_delete}, delivered {len(redelivered)}; "
                  f"SequenceNumber returned: {sequence}")


@check("FIFO: per-message delay, missing group",
       "DelaySeconds per message is refused on FIFO queues; a send without MessageGroupId "
       "fails (MissingParameter)")
def fifo_refusals(probe: Probe) -> Outcome:
    url = probe.queue(fifo=True)
    delayed = _send(probe, url, MessageGroupId="g", MessageDeduplicationId="1", DelaySeconds=1)
    groupless = _send(probe, url, MessageDeduplicationId="2")
    return judged(not delayed.ok and not groupless.ok,
                  f"per-message DelaySeconds: {delayed}; no MessageGroupId: {groupless}")


@check("MessageGroupId on a standard queue",
       "accepted (fair queues, 2025); no ordering, no blocking")
def fair_queue(probe: Probe) -> Outcome:
    url = probe.queue()
    sent = _send(probe, url, MessageGroupId="tenant-1")
    received = probe.receive(url) if sent.ok else []
    group = received[0]["Attributes"].get("MessageGroupId") if received else None
    return judged(sent.ok, f"send: {sent}; group returned on receive: {group}")


@check("redrive policy",
       "after maxReceiveCount receives, the next receive moves the message to the DLQ")
def redrive(probe: Probe) -> Outcome:
    dlq = probe.queue()
    policy = json.dumps({"deadLetterTargetArn": probe.arn(dlq), "maxReceiveCount": "2"})
    url = probe.queue(RedrivePolicy=policy)
    _send(probe, url)
    receives = 0
    for _ in range(4):
        messages = probe.receive(url, WaitTimeSeconds=0)
        if not messages:
            break
        receives += 1
        probe.call("change_message_visibility", QueueUrl=url,
                   ReceiptHandle=messages[0]["ReceiptHandle"], VisibilityTimeout=0)
    moved, _ = probe.receive_until(dlq, within=3)
    count = moved[0]["Attributes"].get("ApproximateReceiveCount") if moved else None
    return judged(receives == 2 and len(moved) == 1,
                  f"received {receives}× from the source, then "
                  f"{'in the DLQ' if moved else 'not in the DLQ'}"
                  + (f" (its ApproximateReceiveCount there: {count})" if moved else ""))


def _ten_received(probe: Probe) -> tuple[str, list[dict[str, Any]]]:
    url = probe.queue()
    probe.sqs.send_message_batch(QueueUrl=url, Entries=[
        {"Id": str(n), "MessageBody": f"m{n}"} for n in range(MAX_BATCH)])
    messages: list[dict[str, Any]] = []
    give_up = time.monotonic() + 5
    while len(messages) < MAX_BATCH and time.monotonic() < give_up:
        messages += probe.receive(url)
    return url, messages


def _batch(probe: Probe, operation: str, url: str, entries: list[dict[str, Any]]) -> str:
    reply = probe.call(operation, QueueUrl=url, Entries=entries)
    if not reply.ok:
        return f"refused: {reply.code}"
    failed = reply.response.get("Failed", [])
    codes = sorted({f"{f['Code']} (SenderFault {f.get('SenderFault')})" for f in failed})
    return f"{len(reply.response.get('Successful', []))} ok, {len(failed)} failed {codes}"


@check("batch calls: 10 entries, partial failure, 11",
       "Delete/ChangeMessageVisibilityBatch take ≤10 entries; a bad entry fails alone "
       "(Failed[] with ReceiptHandleIsInvalid, SenderFault); 11 entries: "
       "TooManyEntriesInBatchRequest; repeated Ids: BatchEntryIdsNotDistinct")
def batches(probe: Probe) -> Outcome:
    url, messages = _ten_received(probe)
    entries = [{"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]}
               for n, m in enumerate(messages)]
    entries[-1] = {"Id": "bad", "ReceiptHandle": "not-a-handle"}
    change = _batch(probe, "change_message_visibility_batch", url,
                    [dict(e, VisibilityTimeout=30) for e in entries])
    delete = _batch(probe, "delete_message_batch", url, entries)
    eleven = {
        ids: probe.call("delete_message_batch", QueueUrl=url, Entries=[
            {"Id": name, "ReceiptHandle": "x"} for name in names])
        for ids, names in (("Ids 0-10", [str(n) for n in range(MAX_BATCH + 1)]),
                           ("Ids a-k", list("abcdefghijk")))
    }
    send_eleven = probe.call("send_message_batch", QueueUrl=url, Entries=[
        {"Id": name, "MessageBody": "m"} for name in "abcdefghijk"])
    twins = probe.call("delete_message_batch", QueueUrl=url, Entries=[
        {"Id": "same", "ReceiptHandle": "x"}, {"Id": "same", "ReceiptHandle": "y"}])
    expected = "9 ok, 1 failed ['ReceiptHandleIsInvalid (SenderFault True)']"
    refused = all(r.refused_with("TooManyEntriesInBatchRequest")
                  for r in (*eleven.values(), send_eleven))
    return judged(len(messages) == MAX_BATCH and change == expected and delete == expected
                  and refused and twins.refused_with("BatchEntryIdsNotDistinct"),
                  f"ChangeMessageVisibilityBatch: {change}; DeleteMessageBatch: {delete}; "
                  + "; ".join(f"11 deletes ({ids}): {reply}" for ids, reply in eleven.items())
                  + f"; 11 sends: {send_eleven}; repeated Ids: {twins}")


@check("message attributes, every type",
       "String, Number, Binary and custom types (String.x, Number.int, Binary.gif) round "
       "trip; MD5OfMessageAttributes per AWS's algorithm; >10 attributes refused")
def attributes(probe: Probe) -> Outcome:
    url = probe.queue()
    sent_attributes: dict[str, dict[str, Any]] = {
        "s": {"DataType": "String", "StringValue": "héllo"},
        "n": {"DataType": "Number", "StringValue": "-1.5e3"},
        "b": {"DataType": "Binary", "BinaryValue": b"\x00\xff\x80"},
        "sx": {"DataType": "String.json", "StringValue": "{}"},
        "ni": {"DataType": "Number.int", "StringValue": "42"},
        "bg": {"DataType": "Binary.gif", "BinaryValue": b"GIF89a"},
    }
    sent = _send(probe, url, MessageAttributes=sent_attributes)
    [message] = probe.receive(url)
    back = message.get("MessageAttributes", {})
    round_trip = {name: {k: v for k, v in value.items() if k in ("DataType", "StringValue",
                                                                  "BinaryValue")}
                  for name, value in back.items()} == sent_attributes
    expected_md5 = _md5_of_attributes(sent_attributes)
    md5_send = sent.response.get("MD5OfMessageAttributes") == expected_md5
    md5_receive = message.get("MD5OfMessageAttributes") == expected_md5
    eleven = {f"a{n}": {"DataType": "String", "StringValue": "v"} for n in range(11)}
    too_many = _send(probe, url, MessageAttributes=eleven)
    not_number = _send(probe, url, MessageAttributes={"n": {"DataType": "Number",
                                                            "StringValue": "abc"}})
    differences = [name for name in sent_attributes
                   if back.get(name, {}).get("DataType") != sent_attributes[name]["DataType"]
                   or back.get(name, {}).get("StringValue", back.get(name, {}).get(
                       "BinaryValue")) != sent_attributes[name].get(
                       "StringValue", sent_attributes[name].get("BinaryValue"))]
    return judged(round_trip and md5_send and md5_receive and not too_many.ok
                  and not not_number.ok,
                  f"round trip: {round_trip}{f' (differ: {differences})' if differences else ''};"
                  f" MD5 on send/receive right: {md5_send}/{md5_receive}; 11 attributes: "
                  f"{too_many}; Number 'abc': {not_number}")


@check("body size limit",
       f"the maximum and default MaximumMessageSize are {BODY_LIMIT:,} B (1 MiB, since "
       f"August 2025; {OLD_BODY_LIMIT:,} B before); larger is refused")
def body_size(probe: Probe) -> Outcome:
    url = probe.queue()
    results = {}
    for size in (OLD_BODY_LIMIT, OLD_BODY_LIMIT + 1, BODY_LIMIT, BODY_LIMIT + 1):
        results[size] = _send(probe, url, "x" * size)
    default = probe.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "MaximumMessageSize"])["Attributes"].get("MaximumMessageSize")
    small = probe.queue(MaximumMessageSize=1024)
    over_own = _send(probe, small, "x" * 1025)
    raise_limit = probe.call("create_queue", QueueName=f"probe-{probe.run_id}-big",
                             Attributes={"MaximumMessageSize": str(BODY_LIMIT)})
    text = ", ".join(f"{size:,} B: {reply}" for size, reply in results.items())
    matches = (results[BODY_LIMIT].ok and not results[BODY_LIMIT + 1].ok and default == str(
        BODY_LIMIT) and not over_own.ok)
    return judged(matches, f"{text}; default MaximumMessageSize {default}; 1,025 B on a "
                           f"1,024 B queue: {over_own}; a queue of 1 MiB: {raise_limit}")


@check("body characters",
       "only #x9 #xA #xD #x20-#xD7FF #xE000-#xFFFD #x10000-#x10FFFF; others refused "
       "(InvalidMessageContents); bodies round trip exactly")
def body_characters(probe: Probe) -> Outcome:
    invalid = {"NUL": "a\x00b", "U+0008": "a\x08b", "U+FFFE": "a\ufffeb",
               "lone surrogate": "a\ud800b"}
    seen, all_refused = [], True
    for name, body in invalid.items():
        url = probe.queue()
        reply = _send(probe, url, body)
        all_refused = all_refused and reply.refused_with("InvalidMessageContents")
        said = str(reply.response.get("Error", {}).get("Message", ""))[:40]
        text = f"{name}: {reply}" + (f" ({said!r})" if not reply.ok else "")
        if reply.ok or reply.code == "500":  # stored anyway? what comes back
            try:
                stored = [m["Body"] for m in probe.receive(url, WaitTimeSeconds=0)]
            except Exception as error:
                stored = [f"receive fails: {type(error).__name__}"]
            text += f", then received {stored!r}"
        seen.append(text)
    url = probe.queue()
    valid = "tab\tcr\rcrlf\r\nemoji\U0001f600 private\ue000 <xml/> & ]]>"
    sent = _send(probe, url, valid)
    [message] = probe.receive(url)
    exact = message["Body"] == valid
    md5 = message["MD5OfBody"] == hashlib.md5(valid.encode()).hexdigest()
    return judged(all_refused and sent.ok and exact and md5,
                  "; ".join(seen) + f"; a valid body with CR, CRLF, U+1F600, U+E000 round "
                                    f"trips exactly: {exact} (MD5OfBody right: {md5})")


@check("AWSTraceHeader (MessageSystemAttributes)",
       "optional on send; returned in Attributes when asked; MD5OfMessageSystemAttributes")
def trace_header(probe: Probe) -> Outcome:
    url = probe.queue()
    header = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
    system = {"AWSTraceHeader": {"DataType": "String", "StringValue": header}}
    sent = _send(probe, url, MessageSystemAttributes=system)
    [message] = probe.receive(url) if sent.ok else [{}]
    returned = message.get("Attributes", {}).get("AWSTraceHeader")
    md5 = sent.response.get("MD5OfMessageSystemAttributes")
    right = md5 == _md5_of_attributes(system)
    return judged(sent.ok and returned == header and right,
                  f"send: {sent}; returned on receive: {returned == header}; "
                  f"MD5OfMessageSystemAttributes on send: "
                  f"{'right' if right else 'wrong' if md5 else 'not returned'}")


@check("ApproximateNumberOfMessages / NotVisible / Delayed",
       "visible, in-flight and delayed messages counted apart")
def approximate_counts(probe: Probe) -> Outcome:
    url = probe.queue()
    for n in range(3):
        _send(probe, url, f"m{n}")
    _send(probe, url, "later", DelaySeconds=60)
    probe.receive(url, count=1)
    attributes = probe.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])[
        "Attributes"]
    seen = tuple(int(attributes.get(name, -1)) for name in (
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed"))
    return judged(seen == (2, 1, 1), f"visible, not visible, delayed = {seen} (sent 3 + 1 "
                                     "delayed, received 1)")


@check("long polling",
       f"WaitTimeSeconds 0-{MAX_WAIT}: returns when a message arrives, or empty at the end; "
       f"{MAX_WAIT + 1} refused; MaxNumberOfMessages 11 refused")
def long_polling(probe: Probe) -> Outcome:
    url = probe.queue()
    started = time.monotonic()
    empty = probe.receive(url, WaitTimeSeconds=2)
    empty_took = time.monotonic() - started
    sender = threading.Timer(0.5, lambda: _send(probe, url, "late"))
    started = time.monotonic()
    sender.start()
    arrived = probe.receive(url, WaitTimeSeconds=5)
    arrived_took = time.monotonic() - started
    sender.join()
    over = probe.call("receive_message", QueueUrl=url, WaitTimeSeconds=MAX_WAIT + 1)
    eleven = probe.call("receive_message", QueueUrl=url, MaxNumberOfMessages=11)
    on_time = 1.8 <= empty_took <= 3.0 and bool(arrived) and arrived_took < 2.0
    return judged(not empty and on_time and not over.ok and not eleven.ok,
                  f"empty 2 s poll returned after {empty_took:.2f}s; a send 0.5 s into a 5 s "
                  f"poll returned after {arrived_took:.2f}s; WaitTimeSeconds {MAX_WAIT + 1}: "
                  f"{over}; MaxNumberOfMessages 11: {eleven}")


@check("empty replies",
       "an empty receive returns no message list (no Messages key); ListQueues with none "
       "returns no QueueUrls")
def empty_replies(probe: Probe) -> Outcome:
    url = probe.queue()
    receive = probe.sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)
    listed = probe.sqs.list_queues(QueueNamePrefix=f"none-{probe.run_id}")
    return judged("Messages" not in receive and "QueueUrls" not in listed,
                  f"Messages: {receive.get('Messages', 'absent')}; QueueUrls: "
                  f"{listed.get('QueueUrls', 'absent')}")


@check("SNS topic → SQS subscription (raw delivery)",
       "raw: the body as published, SNS message attributes as SQS ones; otherwise a JSON "
       "envelope (Type Notification, Message, MessageAttributes)")
def sns_fan_out(probe: Probe) -> Outcome:
    sns = probe.client("sns")
    try:
        topic = sns.create_topic(Name=f"probe-{probe.run_id}")["TopicArn"]
    except Exception as error:  # ElasticMQ serves SQS only: any refusal says so
        return judged(False, f"no SNS on this server ({type(error).__name__}: "
                             f"{str(error)[:80]})")
    raw, wrapped = probe.queue(), probe.queue()
    for url, is_raw in ((raw, "true"), (wrapped, "false")):
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=probe.arn(url),
                      Attributes={"RawMessageDelivery": is_raw})
    sns.publish(TopicArn=topic, Message="hello",
                MessageAttributes={"k": {"DataType": "String", "StringValue": "v"}})
    raw_messages, _ = probe.receive_until(raw, within=5)
    wrapped_messages, _ = probe.receive_until(wrapped, within=5)
    raw_ok = bool(raw_messages) and raw_messages[0]["Body"] == "hello" and raw_messages[0].get(
        "MessageAttributes", {}).get("k", {}).get("StringValue") == "v"
    envelope = json.loads(wrapped_messages[0]["Body"]) if wrapped_messages else {}
    wrapped_ok = (envelope.get("Type") == "Notification" and envelope.get("Message") == "hello"
                  and envelope.get("MessageAttributes", {}).get("k", {}).get("Value") == "v")
    return judged(raw_ok and wrapped_ok,
                  f"raw delivery as published, attributes kept: {raw_ok}; envelope right: "
                  f"{wrapped_ok}")


def _restart_trial(probe: Probe, server: Any, hard: bool) -> tuple[str, bool]:
    """Queue, two messages, one in flight; restart ``server``; what is left, and whether both
    messages are."""
    sqs = _client_of(server)
    url = sqs.create_queue(QueueName=f"probe-{probe.run_id}-restart-{int(hard)}",
                           Attributes={"VisibilityTimeout": "30"})["QueueUrl"]
    for body in ("a", "b"):
        sqs.send_message(QueueUrl=url, MessageBody=body)
    [taken] = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1)["Messages"]
    if hard:
        server.kill()
    else:
        server.stop()
    server.start()
    sqs = _client_of(server)
    try:
        attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])[
            "Attributes"]
    except Exception as error:
        return f"queue gone ({type(error).__name__})", False
    visible = int(attributes["ApproximateNumberOfMessages"])
    in_flight = int(attributes["ApproximateNumberOfMessagesNotVisible"])
    try:
        sqs.delete_message(QueueUrl=url, ReceiptHandle=taken["ReceiptHandle"])
        ack = "ok"
    except Exception as error:
        ack = type(error).__name__
    return (f"queue kept, {visible} visible + {in_flight} in flight (of 1 + 1), a delete with "
            f"the handle from before: {ack}", visible + in_flight == 2)


def _client_of(server: Any) -> Any:
    import boto3

    from tests.sqs_fidelity import PROBE_CLIENT_CONFIG

    return boto3.client("sqs", config=PROBE_CLIENT_CONFIG, **server.client_options)


@check("state across a restart",
       "durable: queues and messages survive (in-flight ones stay hidden until their timeout)")
def restart(probe: Probe) -> Outcome:
    soft, soft_kept = _restart_trial(probe, probe.server, hard=False)
    hard, hard_kept = _restart_trial(probe, probe.server, hard=True)
    return judged(soft_kept and hard_kept, f"SIGTERM → {soft}; SIGKILL → {hard}")
