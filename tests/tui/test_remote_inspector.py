"""F2 for servers without a page map: vLLM's /metrics (a fixture in vLLM's real format), or nothing to show.

vLLM cannot run here (no GPU), so tests/fixtures/vllm_metrics.txt is a /metrics page as vLLM's Prometheus
client writes it, with vLLM's documented metric names and labels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedchat.backends.base import BackendInfo, MemoryUnavailable
from pagedchat.backends.remote_metrics import ServerMetrics, parse_metrics
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.inspector import InspectorView
from pagedchat.tui.inspector_parts import ChatPages
from pagedchat.tui.inspector_remote import render_without_map
from tui_support import StandInBackend, make_config, static_text, wait_for

VLLM = (Path(__file__).parents[1] / "fixtures" / "vllm_metrics.txt").read_text()


def test_vllm_metrics_are_read():
    m = parse_metrics(VLLM)
    assert m == ServerMetrics(source="vllm", kv_usage=0.4375, num_pages=20480, block_size=16, running=3, waiting=1,
                              prefix_queries=51200.0, prefix_hits=38400.0, preemptions=2)
    assert m.hit_rate == 0.75 and m.used_pages == 8960


def test_several_engines_sum_counts_and_average_usage():
    second = VLLM.replace('engine="0"', 'engine="1"').replace("} 0.4375", "} 0.0625")
    both = VLLM + "\n".join(line for line in second.splitlines() if not line.startswith("#")) + "\n"
    m = parse_metrics(both)
    assert (m.running, m.waiting, m.num_pages, m.preemptions) == (6, 2, 40960, 4)
    assert m.kv_usage == 0.25 and m.used_pages == 10240 and m.hit_rate == 0.75


def test_older_vllm_names_and_missing_labels():
    old = "\n".join([
        "# TYPE vllm:gpu_cache_usage_perc gauge", 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5',
        "# TYPE vllm:gpu_prefix_cache_queries_total counter", 'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10',
        "# TYPE vllm:gpu_prefix_cache_hits_total counter", 'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4',
        "# TYPE vllm:cache_config_info gauge", 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1', ""])
    m = parse_metrics(old)
    assert (m.kv_usage, m.hit_rate, m.block_size) == (0.5, 0.4, 16)
    assert (m.num_pages, m.used_pages, m.running) == (None, None, None)


def test_a_page_without_kv_metrics_is_none_and_garbage_raises():
    assert parse_metrics("# TYPE process_open_fds gauge\nprocess_open_fds 12\n") is None
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus\n")


def _chats() -> list[ChatPages]:
    return [ChatPages("a", "Idle chat", "#ff0000", None, (), 100),
            ChatPages("b", "Live chat", "#00ff00", "remote-3", (), 40), ChatPages("c", "Fresh", "#0000ff")]


def test_server_view_says_server_wide_and_marks_estimates():
    text = "\n\n".join(part.plain for part in render_without_map(parse_metrics(VLLM), _chats(), 60))
    assert "server-wide" in text and "every client of this server" in text and "vLLM /metrics" in text
    assert "44% used" in text and "~8960 / 20480" in text and "16 tokens" in text
    assert "75%" in text and "38400 of 51200 tokens" in text
    assert "3 running · 1 waiting" in text and "preemptions 2" in " ".join(text.split())
    assert "pages estimated: tokens / 16" in text
    lines = text.splitlines()
    idle = next(line for line in lines if "Idle chat" in line)
    live = next(line for line in lines if "Live chat" in line)
    fresh = next(line for line in lines if "Fresh" in line)
    assert "idle" in idle and "100 tok" in idle and "~7 pg" in idle          # ceil(100 / 16)
    assert "running" in live and "≥40 tok" in live and "~3 pg" in live
    assert "…" in fresh and "pg" not in fresh


def test_no_block_size_means_tokens_only():
    m = ServerMetrics(source="vllm", kv_usage=0.1)
    text = "\n".join(part.plain for part in render_without_map(m, _chats(), 60))
    assert "tokens only" in text and "pg" not in text and "10% used" in text


async def test_inspector_panel_shows_the_server_view_then_the_unavailable_line(tmp_path):
    views = [parse_metrics(VLLM)]
    info = BackendInfo(model="Qwen/Qwen2.5-72B-Instruct", where="via http://gpu-box:8000/v1", block_size=16,
                       num_pages=20480)
    app = PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: StandInBackend(lambda: views[0], info))
    async with app.run_test(size=(100, 32)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the stand-in")
        assert "Qwen/Qwen2.5-72B-Instruct via http://gpu-box:8000/v1 · 20480 pages" in static_text(app, "#status")
        await pilot.press("f2")
        inspector = app.query_one(InspectorView)
        await wait_for(pilot, lambda: "server-wide" in static_text(app, "#insp-remote"), "the server view")
        assert not app.query_one("#insp-map").display and app.query_one("#insp-remote").display
        views[0] = MemoryUnavailable("http://gpu-box:8000/v1 serves neither /v1/memory nor vLLM's /metrics")
        await wait_for(pilot, lambda: "serves neither" in static_text(app, "#insp-remote"), "the plain line")
        assert inspector.last_snapshot is None
