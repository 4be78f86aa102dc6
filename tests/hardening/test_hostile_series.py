"""`--server-log` files (Prometheus scrapes, query_range JSON, bench's metrics_timeline.csv) as
untrusted input: a broken shape or a value no server state can have is an error naming the
file and what was expected, never a traceback or an infinite KV usage in the comparison."""
from __future__ import annotations

import pytest

from sim.errors import UserError
from sim.vllm.timeseries import load_series

RUNNING = '{"metric": {"__name__": "vllm:num_requests_running"}, "values": %s}'

BAD_FILES = {
    "q_result_not_object.json": ('{"data": {"result": [5]}}', r"data.result\[0\] is 5, expected an object"),
    "q_value_not_number.json": ('{"data": {"result": [%s]}}' % (RUNNING % '[[1, "abc"]]'),
                                r"data.result\[0\].values\[0\] is \[1, 'abc'\], expected \[time, value\]"),
    "q_value_triple.json": ('{"data": {"result": [%s]}}' % (RUNNING % '[[1, "1", 3]]'),
                            r"data.result\[0\].values\[0\] is \[1, '1', 3\], expected \[time, value\]"),
    "q_values_not_list.json": ('{"data": {"result": [%s]}}' % (RUNNING % '7'),
                               r"data.result\[0\].values is 7, expected a list of \[time, value\] pairs"),
    "q_infinite.json": ('{"data": {"result": [%s]}}' % (RUNNING % '[[1, "-Inf"], [2, "1"]]'),
                        r"the sample at t = 0 s has running = -inf, expected a finite number >= 0"),
    "q_infinite_time.json": ('{"data": {"result": [%s]}}' % (RUNNING % '[["inf", "1"], [1, "1"]]'),
                             r"a sample's time is not a finite number of seconds"),
    "scrapes_inf.txt": ("# TIME 1700000000\nvllm:num_requests_running inf\n"
                        "# TIME 1700000002\nvllm:num_requests_running 1\n",
                        r"the sample at t = 0 s has running = inf, expected a finite number >= 0"),
    "scrapes_kv.txt": ("# TIME 1700000000\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc -2\n",
                       r"the sample at t = 0 s has kv_usage_pct = -200, expected a finite number from 0 to 100"),
    "scrapes_ms.txt": ("vllm:num_requests_running 1 99999999999999999999999999999\n"
                       "vllm:num_requests_running 2 1\n",
                       r"the samples span 1e\+26 s, more than 30 days"),
    "timeline.csv": ("t_s,running,waiting,kv_usage\n0,inf,1,0.5\n1,1,1,0.5\n",
                     r"the sample at t = 0 s has running = inf, expected a finite number >= 0"),
    "timeline_kv.csv": ("t_s,running,waiting,kv_usage\n0,1,1,7\n",
                        r"the sample at t = 0 s has kv_usage_pct = 700, expected a finite number from 0 to 100"),
    "log_month_13.log": ("INFO 13-45 25:61:99 [loggers.py:123] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
                         "Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.0%\n",
                         r":1: the time of this line is no date \(month must be in 1..12\)"),
    "log_request_feb_30.log": ("INFO 02-30 10:00:00 [logger.py:40] Received request cmpl-1\n",
                               r":1: the time of this line is no date \(day is out of range for month\)"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_hostile_series_file_is_a_clean_error(tmp_path, name):
    text, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=expected) as caught:
        load_series(path, year=2025)
    assert str(caught.value).startswith(str(path))
