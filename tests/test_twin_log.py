"""What a failed twin test shows: the failed checks first, then the log's tail."""

from __future__ import annotations

from tests.e2e import twin_log


def test_a_failure_leads_with_its_failed_checks_though_the_tail_is_other_lines() -> None:
    noise = [f'{{"message": "request {i}"}}' for i in range(200)]
    output = "\n".join(["PASS [a] first", "FAIL [a] series: no live series for x", *noise, "PASS [a] last"])
    message = twin_log.failure_message(output).splitlines()
    assert message[0] == "FAIL [a] series: no live series for x"
    assert message[1] == "--- the log's last lines:"
    assert message[-1] == "PASS [a] last" and len(message) == 2 + twin_log.TAIL_LINES
    assert twin_log.verdicts(output) == ["PASS [a] first", "FAIL [a] series: no live series for x", "PASS [a] last"]
    assert twin_log.failures("PASS [a] ok\n-- [a] note") == []
