#include "server/ops/status_page.h"

#include <utility>

namespace muond::server {
namespace {

// The page. Data from the daemon is put into the DOM as text (textContent, SVG attributes), never
// as markup, so a job id or a fence reason cannot inject anything.
constexpr char kHtml[] = R"HTML(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>muond status</title>
<style>
:root{--bg:#f6f7f9;--card:#fff;--ink:#1d2430;--dim:#5f6b7a;--line:#dde2e8;--bad:#c0392b;--ok:#2e7d32}
*{box-sizing:border-box}
body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;background:var(--bg);color:var(--ink)}
header{display:flex;align-items:baseline;gap:16px;padding:12px 20px;background:#1d2430;color:#fff}
header h1{font-size:18px;margin:0}
header .sub{color:#b8c2cf;font-size:13px}
main{padding:16px 20px;display:grid;gap:16px}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:12px 16px}
.card h2{font-size:15px;margin:0 0 8px}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0}
dl.facts dt{color:var(--dim)}
dl.facts dd{margin:0;font-variant-numeric:tabular-nums}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);font-variant-numeric:tabular-nums;vertical-align:top}
th{color:var(--dim);font-weight:600;font-size:12px}
.badge{display:inline-block;padding:0 6px;border-radius:4px;font-size:12px;background:#e8eef5}
.badge.bad{background:#fbe3e0;color:var(--bad)}
.badge.ok{background:#e3f3e4;color:var(--ok)}
.charts{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.chart h3{font-size:13px;margin:4px 0;color:var(--dim);font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:10px;font-size:12px;color:var(--dim)}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px}
.bar{height:10px;background:#e8eef5;border-radius:5px;overflow:hidden;min-width:160px}
.bar div{height:100%;background:#4e79a7}
#error{color:var(--bad);font-weight:600}
.empty{color:var(--dim)}
svg text{font-size:10px;fill:#5f6b7a}
</style>
</head>
<body data-errors="0" data-refreshes="0">
<header><h1>muond</h1><span class="sub" id="headline">loading…</span></header>
<main>
<div id="error" hidden></div>
<section class="card" id="daemon"><h2>Daemon</h2><dl class="facts" id="daemon-facts"></dl></section>
<section class="card"><h2>Jobs</h2>
<table id="jobs"><thead><tr><th>Job</th><th>Mode</th><th>World</th><th>ZeRO stage</th>
<th>Ranks attached</th><th>Step</th><th>State</th><th>State bytes</th><th>Newest checkpoint</th></tr></thead>
<tbody></tbody></table></section>
<section class="card" id="operations-card"><h2>Checkpoint operations</h2><div id="operations"></div></section>
<div id="job-cards"></div>
</main>
<script>
(function () {
'use strict';
var errors = 0, refreshes = 0, body = document.body;
function fail(message) {
  errors++;
  body.setAttribute('data-errors', String(errors));
  var e = document.getElementById('error');
  e.textContent = message;
  e.hidden = false;
}
window.addEventListener('error', function (ev) { fail('script error: ' + ev.message); });
window.addEventListener('unhandledrejection', function (ev) { fail('script error: ' + ev.reason); });
var consoleError = console.error;
console.error = function () {
  fail('console error: ' + Array.prototype.join.call(arguments, ' '));
  consoleError.apply(console, arguments);
};
document.addEventListener('securitypolicyviolation', function (ev) {
  fail('blocked by the content security policy: ' + ev.blockedURI);
});
var SVGNS = 'http://www.w3.org/2000/svg';
var COLORS = ['#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#b07aa1'];
var REFRESH_MS = 2000;
function el(tag, attrs, text) {
  var e = document.createElement(tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function sv(tag, attrs, text) {
  var e = document.createElementNS(SVGNS, tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bytes(n) {
  if (n === null || n === undefined) return 'unlimited';
  var units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + ' ' + units[i];
}
function dur(s) {
  if (s === null || s === undefined) return '-';
  if (s < 1e-3) return (s * 1e6).toFixed(0) + ' µs';
  if (s < 1) return (s * 1e3).toFixed(1) + ' ms';
  if (s < 120) return s.toFixed(1) + ' s';
  if (s < 7200) return (s / 60).toFixed(1) + ' min';
  if (s < 172800) return (s / 3600).toFixed(1) + ' h';
  return (s / 86400).toFixed(1) + ' d';
}
function fact(dl, key, value) {
  dl.appendChild(el('dt', {}, key));
  dl.appendChild(el('dd', {}, value));
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

function renderDaemon(s) {
  var d = s.daemon;
  document.getElementById('headline').textContent =
      d.version + ' · ' + d.backend + ' · up ' + dur(d.uptime_seconds) + ' · ' + d.metrics_address;
  var dl = clear(document.getElementById('daemon-facts'));
  fact(dl, 'Version', d.version);
  fact(dl, 'Backend', d.backend + ' (' + d.device + ')');
  fact(dl, 'Why this backend', d.backend_why);
  fact(dl, 'CPU math', d.cpu_math);
  fact(dl, 'Uptime', dur(d.uptime_seconds));
  fact(dl, 'Jobs', String(d.jobs));
  fact(dl, 'State held', bytes(d.state_bytes) + ' (momentum and masters ' + bytes(d.momentum_bytes) + ')');
  fact(dl, 'Pinned memory', bytes(d.pinned_bytes) + ' of ' + bytes(d.memlock_limit_bytes) +
       ' (RLIMIT_MEMLOCK), ' + d.shm_sessions + ' shared-memory sessions');
  fact(dl, 'Compute queue', String(d.compute_queue_depth) + ' tasks waiting');
  var limits = Object.keys(d.limits).sort().map(function (k) { return k + ' ' + d.limits[k]; });
  fact(dl, 'Limits in force', limits.join(', '));
}

function ranksText(job) {
  var shm = 0, grpc = 0;
  job.ranks.forEach(function (r) { if (r.transport === 'shm') shm++; if (r.transport === 'grpc') grpc++; });
  var parts = [];
  if (shm) parts.push(shm + ' shm');
  if (grpc) parts.push(grpc + ' gRPC');
  return job.ranks_attached + ' / ' + job.world_size + (parts.length ? ' (' + parts.join(', ') + ')' : '');
}

// Host bytes by kind, held now (README, "Memory"); kinds holding nothing are left out.
function memoryText(memory) {
  var parts = [];
  Object.keys(memory).forEach(function (kind) {
    var held = memory[kind].bytes;
    if (held > 0) parts.push(kind.replace('_', ' ') + ' ' + bytes(held));
  });
  return parts.join(', ');
}

function renderJobs(s) {
  var tbody = clear(document.querySelector('#jobs tbody'));
  if (!s.jobs.length) tbody.appendChild(el('tr', {}, '')).appendChild(el('td', {colspan: '9', 'class': 'empty'}, 'no jobs'));
  s.jobs.forEach(function (j) {
    var tr = el('tr', {'class': 'job-row', 'data-job': j.id});
    tr.appendChild(el('td', {}, j.id));
    tr.appendChild(el('td', {}, j.mode));
    tr.appendChild(el('td', {}, String(j.world_size)));
    tr.appendChild(el('td', {}, String(j.zero_stage)));
    tr.appendChild(el('td', {}, ranksText(j)));
    tr.appendChild(el('td', {}, j.next_step + (j.step_in_flight !== null ? ' (in flight)' : '')));
    var state = el('td', {});
    state.appendChild(el('span', {'class': j.fenced ? 'badge bad' : 'badge ok'}, j.fenced ? 'fenced' : 'serving'));
    if (j.fenced) state.appendChild(el('div', {}, j.fence_reason));
    tr.appendChild(state);
    var held = el('td', {}, bytes(j.state_bytes) + ' ' + j.state_kind);
    held.appendChild(el('div', {'class': 'memory'}, 'host ' + bytes(j.memory_bytes) + ' of ' +
                        bytes(j.footprint_bytes) + ' reserved: ' + memoryText(j.memory)));
    tr.appendChild(held);
    tr.appendChild(el('td', {}, j.checkpoint ? 'step ' + j.checkpoint.step + ', ' + dur(j.checkpoint.age_seconds) + ' ago' : 'none'));
    tbody.appendChild(tr);
  });
}

function legend(phases) {
  var div = el('div', {'class': 'legend'});
  phases.forEach(function (p, i) {
    var span = el('span', {});
    span.appendChild(el('i', {style: 'background:' + COLORS[i % COLORS.length]}));
    span.appendChild(document.createTextNode(p.replace('_', ' ')));
    div.appendChild(span);
  });
  return div;
}

// The last steps of a job, one bar each, its phases stacked bottom to top.
function phaseBars(job, phases) {
  var steps = job.recent_steps, W = 480, H = 160, left = 44, top = 8, bottom = 18;
  var g = sv('svg', {'class': 'phase-bars', width: W, height: H, viewBox: '0 0 ' + W + ' ' + H,
                     'data-steps': String(steps.length), role: 'img'});
  var max = 0;
  steps.forEach(function (st) {
    var t = st.phases.reduce(function (a, b) { return a + b; }, 0);
    if (t > max) max = t;
  });
  if (max <= 0) max = 1e-6;
  var plotH = H - top - bottom, slot = (W - left) / Math.max(steps.length, 1);
  g.appendChild(sv('line', {x1: left, y1: top + plotH, x2: W, y2: top + plotH, stroke: '#ccd'}));
  g.appendChild(sv('text', {x: 2, y: top + 8}, dur(max)));
  g.appendChild(sv('text', {x: 2, y: top + plotH}, '0'));
  steps.forEach(function (st, i) {
    var y = top + plotH, x = left + i * slot + slot * 0.1, w = Math.max(slot * 0.8, 1);
    st.phases.forEach(function (sec, p) {
      var h = sec / max * plotH;
      y -= h;
      var r = sv('rect', {'class': 'phase phase-' + phases[p], x: x.toFixed(2), y: y.toFixed(2),
                          width: w.toFixed(2), height: Math.max(h, 0).toFixed(2),
                          fill: COLORS[p % COLORS.length]});
      r.appendChild(sv('title', {}, 'step ' + st.step + ': ' + phases[p] + ' ' + dur(sec)));
      g.appendChild(r);
    });
  });
  if (steps.length) {
    g.appendChild(sv('text', {x: left, y: H - 4}, 'step ' + steps[0].step));
    g.appendChild(sv('text', {x: W - 60, y: H - 4}, 'step ' + steps[steps.length - 1].step));
  }
  return g;
}

// Wall time of each kept step, as a line.
function stepLine(job) {
  var steps = job.recent_steps, W = 360, H = 160, left = 44, top = 8, bottom = 18;
  var g = sv('svg', {'class': 'step-time', width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, role: 'img'});
  var max = 0;
  steps.forEach(function (st) { if (st.seconds > max) max = st.seconds; });
  if (max <= 0) max = 1e-6;
  var plotH = H - top - bottom, dx = (W - left - 4) / Math.max(steps.length - 1, 1);
  g.appendChild(sv('line', {x1: left, y1: top + plotH, x2: W, y2: top + plotH, stroke: '#ccd'}));
  g.appendChild(sv('text', {x: 2, y: top + 8}, dur(max)));
  g.appendChild(sv('text', {x: 2, y: top + plotH}, '0'));
  var points = steps.map(function (st, i) {
    return (left + i * dx).toFixed(2) + ',' + (top + plotH - st.seconds / max * plotH).toFixed(2);
  });
  if (points.length) {
    g.appendChild(sv('polyline', {points: points.join(' '), fill: 'none', stroke: '#4e79a7', 'stroke-width': 2}));
    g.appendChild(sv('text', {x: left, y: H - 4}, 'step ' + steps[0].step));
    g.appendChild(sv('text', {x: W - 60, y: H - 4}, 'step ' + steps[steps.length - 1].step));
  }
  return g;
}

// The optimizer's own series (server/record/optimizer_metrics.h) in a job's card: facts, and the
// Newton-Schulz time by shape class as a table with each class's share of the time.
function optimizerFacts(dl, o) {
  fact(dl, 'Orthogonality', o.orthogonality
       ? '||UU\u1d40 \u2212 I||/\u221ar ' + o.orthogonality.value.toFixed(4) + ' at step ' +
         o.orthogonality.step + ' (' + o.orthogonality.matrices +
         (o.orthogonality.matrices === 1 ? ' matrix' : ' matrices') + ' sampled)'
       : 'not sampled yet');
  fact(dl, 'Trainer view', o.trainer
       ? 'step ' + o.trainer.step + ': ' + dur(o.trainer.visible_seconds) + ' first gradient to last update, ' +
         dur(o.trainer.wait_seconds) + ' after the last gradient'
       : 'no step yet');
  if (o.qk_clip) {
    fact(dl, 'QK-Clip', o.qk_clip.pairs + ' attention pairs at threshold ' + o.qk_clip.threshold +
         ': ' + o.qk_clip.heads_clipped + ' query heads clipped; newest largest logit ' +
         (o.qk_clip.max_logit === null ? 'none yet' : o.qk_clip.max_logit.toFixed(2)));
  }
  fact(dl, 'Pipeline', o.matrices_waiting + ' matrices waiting for the device, ' +
       bytes(o.gather_in_use_bytes) + ' of the gather budget in use');
  fact(dl, 'Pinned', Object.keys(o.pinned_bytes).map(function (k) {
    return k.replace('_', ' ') + ' ' + bytes(o.pinned_bytes[k]);
  }).join(', '));
}

function shapeTable(o) {
  var div = el('div', {'class': 'chart ns-shapes'});
  div.appendChild(el('h3', {}, 'Newton\u2013Schulz time by shape'));
  if (!o.newton_schulz.length) { div.appendChild(el('p', {'class': 'empty'}, 'no Muon matrix')); return div; }
  var total = o.newton_schulz.reduce(function (a, t) { return a + t.seconds; }, 0);
  var table = el('table', {});
  var head = el('tr', {});
  ['Shape', 'Per step', 'Per matrix', 'Share'].forEach(function (h) { head.appendChild(el('th', {}, h)); });
  table.appendChild(head);
  o.newton_schulz.forEach(function (t) {
    var tr = el('tr', {'class': 'ns-shape', 'data-shape': t.shape});
    tr.appendChild(el('td', {}, t.shape));
    tr.appendChild(el('td', {}, String(t.per_step)));
    tr.appendChild(el('td', {}, t.matrices ? dur(t.mean_seconds) : '\u2013'));
    var frac = total > 0 ? t.seconds / total : 0;
    var cell = el('td', {}), bar = el('div', {'class': 'bar', title: (100 * frac).toFixed(1) + '%'});
    bar.appendChild(el('div', {style: 'width:' + (100 * frac).toFixed(1) + '%'}));
    cell.appendChild(bar);
    tr.appendChild(cell);
    table.appendChild(tr);
  });
  div.appendChild(table);
  return div;
}

function renderJobCards(s) {
  var cards = clear(document.getElementById('job-cards'));
  s.jobs.forEach(function (j) {
    var card = el('section', {'class': 'card job-card', 'data-job': j.id});
    card.appendChild(el('h2', {}, 'Job ' + j.id));
    var dl = el('dl', {'class': 'facts'});
    fact(dl, 'Steps', j.steps_completed + ' committed, ' + j.steps_refused + ' refused, ' +
         (j.steps_skipped ? j.steps_skipped + ' skipped, ' : '') +
         j.steps_aborted + ' aborted');
    fact(dl, 'Ranks', j.ranks.map(function (r) {
      return r.rank + ':' + (r.attached ? r.transport : 'detached');
    }).join('  '));
    optimizerFacts(dl, j.optimizer);
    card.appendChild(dl);
    var charts = el('div', {'class': 'charts'});
    var a = el('div', {'class': 'chart'});
    a.appendChild(el('h3', {}, 'Last ' + j.recent_steps.length + ' steps by phase'));
    a.appendChild(phaseBars(j, s.phases));
    a.appendChild(legend(s.phases));
    var b = el('div', {'class': 'chart'});
    b.appendChild(el('h3', {}, 'Step time'));
    b.appendChild(stepLine(j));
    charts.appendChild(a);
    charts.appendChild(b);
    charts.appendChild(shapeTable(j.optimizer));
    card.appendChild(charts);
    cards.appendChild(card);
  });
}

function renderOperations(s) {
  var div = clear(document.getElementById('operations'));
  if (!s.operations.length) { div.appendChild(el('p', {'class': 'empty'}, 'none recently')); return; }
  var table = el('table', {});
  s.operations.forEach(function (o) {
    var tr = el('tr', {'class': 'operation'});
    var frac = o.bytes_total ? o.bytes_done / o.bytes_total : (o.done ? 1 : 0);
    tr.appendChild(el('td', {}, o.kind + ' ' + o.job + (o.target && o.target !== o.job ? ' → ' + o.target : '')));
    var cell = el('td', {}), bar = el('div', {'class': 'bar'});
    bar.appendChild(el('div', {style: 'width:' + (100 * frac).toFixed(1) + '%'}));
    cell.appendChild(bar);
    tr.appendChild(cell);
    tr.appendChild(el('td', {}, bytes(o.bytes_done) + ' / ' + bytes(o.bytes_total)));
    tr.appendChild(el('td', {}, o.done ? (o.error ? 'failed: ' + o.error : 'done') : 'running'));
    table.appendChild(tr);
  });
  div.appendChild(table);
}

function render(s) {
  renderDaemon(s);
  renderJobs(s);
  renderOperations(s);
  renderJobCards(s);
}

function refresh() {
  fetch('/api/v1/status', {cache: 'no-store'}).then(function (r) {
    if (!r.ok) throw new Error('HTTP ' + r.status);
    return r.json();
  }).then(function (s) {
    render(s);
    refreshes++;
    body.setAttribute('data-refreshes', String(refreshes));
    document.getElementById('error').hidden = true;
  }).catch(function (e) {
    fail('cannot read /api/v1/status: ' + e.message);
  }).then(function () { setTimeout(refresh, REFRESH_MS); });
}
refresh();
})();
</script>
</body>
</html>
)HTML";

constexpr char kHtmlHeaders[] =
    "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'\r\n"
    "X-Content-Type-Options: nosniff\r\n";

}  // namespace

const std::string& StatusPageHtml() {
  static const std::string* html = new std::string(kHtml);
  return *html;
}

std::vector<MetricsPage> StatusPages(std::function<std::string()> render_json) {
  std::vector<MetricsPage> pages;
  // Both only for requests addressed to the daemon (check_host): a page of another origin whose
  // DNS name rebinds to this address cannot read the status.
  pages.push_back({kStatusPagePath, "text/html; charset=utf-8", kHtmlHeaders,
                   [] { return StatusPageHtml(); }, /*check_host=*/true});
  pages.push_back({kStatusJsonPath, "application/json", "X-Content-Type-Options: nosniff\r\n",
                   std::move(render_json), /*check_host=*/true});
  return pages;
}

}  // namespace muond::server
