// The report's script: builds the trajectory list from the JSON block #agentrl-data. Run text
// (model output, tool results, errors) goes in with textContent only, never as markup.
(function () {
"use strict";
var D = JSON.parse(document.getElementById("agentrl-data").textContent);
var T = D.trajs, VOCAB = D.vocab || {}, PIECES = D.pieces || {}, TOK_OK = D.tokenizer && D.tokenizer.ok;
var STATUSES = ["completed", "truncated", "aborted", "failed"];

function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function num(x, d) {
  if (x === null || x === undefined || typeof x !== "number" || !isFinite(x)) return "–";
  if (d === undefined) d = 3;
  return Math.abs(x) >= 1000 ? x.toFixed(0) : String(Number(x.toFixed(d)));
}
function secs(x) { return (x === null || x === undefined) ? "–" : num(x, x < 1 ? 3 : 2) + " s"; }
function expand(rle) { var out = []; for (var i = 0; i < rle.length; i++) for (var k = 0; k < rle[i][1]; k++) out.push(rle[i][0]); return out; }
function tokText(id) { if (!TOK_OK) return "[" + id + "]"; var t = VOCAB[id]; return t === undefined ? "[" + id + "]" : t; }

// Text into a span: control characters shown as \xNN and newlines as ↵ (dimmed, the line
// still breaks), so that every token, whitespace included, has something to see and hover.
function fillText(span, text) {
  var re = /[\u0000-\u0009\u000b-\u001f\u007f]|\n/g, last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) span.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[0] === "\n") { span.appendChild(el("span", "esc", "↵")); span.appendChild(document.createTextNode("\n")); }
    else if (m[0] === "\t") { span.appendChild(el("span", "esc", "→")); span.appendChild(document.createTextNode("\t")); }
    else span.appendChild(el("span", "esc", "\\x" + m[0].charCodeAt(0).toString(16).padStart(2, "0")));
    last = m.index + 1;
  }
  if (last < text.length) span.appendChild(document.createTextNode(text.slice(last)));
  if (text.length === 0) span.appendChild(el("span", "esc", "∅"));
}

// Token spans for ids[start:end]. kind: "prompt" or "resp".
function renderTokens(t, kind, start, end) {
  var box = el("div", "tokens");
  var ids = kind === "prompt" ? t.prompt : t.resp;
  var merges = {};
  (t.merges && t.merges[kind === "prompt" ? "p" : "r"] || []).forEach(function (m) { merges[m[0]] = m; });
  var d = kind === "resp" ? derived(t) : null;
  var i = start;
  while (i < end) {
    var m = merges[i], n = m ? Math.min(m[1], end - i) : 1;
    var text = m ? m[2] : tokText(ids[i]);
    var span = el("span", "tok " + (kind === "prompt" ? "tok-prompt" : (d.mask[i] ? "m1" : "m0")));
    span.dataset.pos = String(i);
    if (n > 1) span.dataset.n = String(n);
    if (kind === "resp" && d.mask[i] && typeof d.lp[i] === "number") span.dataset.lp = String(d.lp[i]);
    if (/^<\|.*\|>$/.test(text) || /^<\/?s>$/.test(text)) span.classList.add("special");
    fillText(span, text);
    box.appendChild(span);
    i += n;
  }
  if (start === end) box.appendChild(el("span", "muted", "(no tokens)"));
  BOXES.set(box, {t: t, kind: kind});
  return box;
}

// A token's tooltip, made when the pointer first reaches it (cheap pages for long trajectories).
var BOXES = new WeakMap();
function tokenTitle(span) {
  var info = BOXES.get(span.parentNode);
  if (!info) return;
  var t = info.t, kind = info.kind, ids = kind === "prompt" ? t.prompt : t.resp, d = kind === "resp" ? derived(t) : null;
  var i = +span.dataset.pos, n = +(span.dataset.n || 1), lines = [];
  for (var k = i; k < i + n; k++) {
    var id = ids[k], line = "token " + k + " · id " + id + " " + JSON.stringify(tokText(id));
    if (PIECES[id] !== undefined) line += " (piece " + JSON.stringify(PIECES[id]) + ")";
    if (kind === "resp" && d.mask[k]) {
      var lp = d.lp[k];
      line += "\nlogprob " + num(lp, 4) + (typeof lp === "number" ? " (p = " + num(Math.exp(lp), 4) + ")" : "") +
              " · policy version " + d.ver[k] + " · loss mask 1 (trained)";
    } else if (kind === "resp") {
      line += "\nloss mask 0 (env/tool/template, not trained)";
    } else {
      line += "\nprompt (not trained)";
    }
    lines.push(line);
  }
  span.title = lines.join("\n");
}
document.addEventListener("mouseover", function (e) {
  var span = e.target && e.target.closest ? e.target.closest(".tokens .tok") : null;
  if (span && !span.title) tokenTitle(span);
});
document.addEventListener("focusin", function (e) {
  if (e.target && e.target.matches && e.target.matches(".tokens .tok") && !e.target.title) tokenTitle(e.target);
});

function derived(t) {
  if (t._d) return t._d;
  var mask = expand(t.mask), ver = expand(t.ver), lp = new Array(mask.length), j = 0;
  for (var i = 0; i < mask.length; i++) lp[i] = mask[i] ? t.lp[j++] : null;
  // segments: runs of equal mask; a run of 1s opens a turn, the 0s after it are its observation
  var segs = [], s = 0;
  for (i = 1; i <= mask.length; i++) if (i === mask.length || mask[i] !== mask[s]) { segs.push([mask[s], s, i]); s = i; }
  t._d = {mask: mask, ver: ver, lp: lp, segs: segs};
  return t._d;
}

function kv(pairs) {
  var dl = el("dl", "kv");
  pairs.forEach(function (p) { if (p[1] === null || p[1] === undefined || p[1] === "") return;
    dl.appendChild(el("dt", null, p[0])); var dd = el("dd"); if (p[1] instanceof Node) dd.appendChild(p[1]); else dd.textContent = String(p[1]); dl.appendChild(dd); });
  return dl;
}
function messageBox(m) {
  var wrap = el("div");
  var head = el("div", "role", m.role + (m.name ? " · " + m.name : "") + (m.tool_call_id ? " · " + m.tool_call_id : ""));
  wrap.appendChild(head);
  wrap.appendChild(el("pre", "msg", m.content));
  return wrap;
}
function callBox(c) {
  var box = el("div", "call" + (c.error ? " bad" : ""));
  var head = el("div");
  head.appendChild(el("span", null, "tool call "));
  head.appendChild(el("span", "name", c.name || "?"));
  if (c.id) head.appendChild(el("span", "muted", " · " + c.id));
  box.appendChild(head);
  if (c.arguments !== undefined) box.appendChild(el("pre", "msg", c.arguments));
  if (c.error) box.appendChild(el("pre", "err", "malformed call: " + c.error));
  if (c.raw && c.arguments === undefined) box.appendChild(el("pre", "msg", c.raw));
  return box;
}

function renderBody(t, body) {
  var d = derived(t);
  var stage = t.stage || {};
  var reward = t.parts ? Object.keys(t.parts).map(function (k) { return k + " = " + num(t.parts[k], 4); }).join(", ") : num(t.reward, 4);
  var versions = d.ver.filter(function (v) { return v >= 0; });
  body.appendChild(kv([
    ["trajectory", t.id + " (iteration " + t.it + ", group " + t.group + ")"],
    ["env", t.env],
    ["status", t.status],
    ["reward", reward],
    ["label", t.label],
    ["tokens", t.prompt.length + " prompt · " + t.resp.length + " response (" + t.trained + " trained, " + (t.resp.length - t.trained) + " masked)"],
    ["policy versions", versions.length ? Math.min.apply(null, versions) + (Math.max.apply(null, versions) !== Math.min.apply(null, versions) ? "–" + Math.max.apply(null, versions) : "") : null],
    ["timings", "generation " + secs(stage.generate_s) + " · env/tool " + secs(stage.env_s) +
                " · reward " + (stage.reward_s !== undefined ? secs(stage.reward_s) : "not recorded separately (computed in the env step: part of env/tool time)")],
  ]));
  if (t.error) body.appendChild(el("pre", "err", t.error));
  if (t.traceback) { var tb = el("details"); tb.appendChild(el("summary", null, "traceback")); tb.appendChild(el("pre", "err", t.traceback)); body.appendChild(tb); }
  if (t.problems && t.problems.length) body.appendChild(el("div", "problems", "problems: " + t.problems.join("; ")));
  if (t.meta && Object.keys(t.meta).length) { var md = el("details"); md.appendChild(el("summary", null, "metadata")); md.appendChild(el("pre", "meta", JSON.stringify(t.meta, null, 1))); body.appendChild(md); }

  var pd = el("details", "prompt");
  pd.appendChild(el("summary", null, "prompt (" + t.prompt.length + " tokens, " + t.prompt_msgs.length + " messages)"));
  t.prompt_msgs.forEach(function (m) { pd.appendChild(messageBox(m)); });
  pd.appendChild(el("div", "block-label", "prompt tokens"));
  pd.appendChild(renderTokens(t, "prompt", 0, t.prompt.length));
  body.appendChild(pd);

  var turn = -1, box = null, segs = d.segs;
  if (!segs.length) body.appendChild(el("p", "muted", "no response tokens"));
  segs.forEach(function (seg) {
    if (seg[0] === 1 || box === null) {
      turn += 1;
      box = el("div", "turn");
      box.dataset.turn = String(turn);
      var tm = (t.timings || [])[turn] || {};
      var extra = Object.keys(tm).filter(function (k) { return k !== "generate_s" && k !== "env_s"; })
        .map(function (k) { return k.replace(/_s$/, "") + " " + secs(tm[k]); }).join(" · ");
      var h = el("h4", null, "turn " + (turn + 1));
      h.appendChild(el("span", "timing", "  generation " + secs(tm.generate_s) + " · env/tool " + secs(tm.env_s) + (extra ? " · " + extra : "")));
      box.appendChild(h);
      body.appendChild(box);
    }
    var msgs = (t.turn_msgs || [])[turn];
    if (seg[0] === 1) {
      box.appendChild(el("div", "block-label", "assistant · " + (seg[2] - seg[1]) + " trained tokens"));
      box.appendChild(renderTokens(t, "resp", seg[1], seg[2]));
      if (msgs) msgs.calls.forEach(function (c) { box.appendChild(callBox(c)); });
    } else {
      box.appendChild(el("div", "block-label", "env / tool / template · " + (seg[2] - seg[1]) + " masked tokens"));
      if (msgs) msgs.obs.forEach(function (m) { box.appendChild(messageBox(m)); });
      box.appendChild(renderTokens(t, "resp", seg[1], seg[2]));
    }
  });
  var end = el("div", "timing", "end: " + t.status + " · reward " + reward + " after " + t.turns + " turn(s)");
  body.appendChild(end);
  if (document.getElementById("shade").checked) shade(body, true);
}

// -- list ---------------------------------------------------------------------------------
var list = document.getElementById("list");
var cards = [];
T.forEach(function (t, idx) {
  var card = el("div", "traj");
  card.dataset.idx = String(idx); card.dataset.status = t.status; card.dataset.it = String(t.it);
  var head = el("div", "traj-head");
  head.setAttribute("role", "button"); head.tabIndex = 0;
  var caret = el("span", "caret", "▸");
  head.appendChild(caret);
  head.appendChild(el("span", "tid", t.id));
  head.appendChild(el("span", "muted", "it " + t.it + (t.env ? " · " + t.env : "")));
  head.appendChild(el("span", "badge st-" + t.status, t.status));
  head.appendChild(el("span", null, t.status === "failed" ? "reward – (failed: not scored)" : "reward " + num(t.reward, 4)));
  head.appendChild(el("span", null, t.turns + " turn" + (t.turns === 1 ? "" : "s")));
  head.appendChild(el("span", null, t.resp.length + " tok (" + t.trained + " trained)"));
  var st = t.stage || {};
  head.appendChild(el("span", "timing", "gen " + secs(st.generate_s) + " · env " + secs(st.env_s) + (st.reward_s !== undefined ? " · reward " + secs(st.reward_s) : "")));
  if (t.error) head.appendChild(el("span", "problems", t.error.length > 80 ? t.error.slice(0, 80) + "…" : t.error));
  var body = el("div", "traj-body"); body.hidden = true;
  function toggle(open) {
    if (open === undefined) open = body.hidden;
    if (open && !body.dataset.rendered) { renderBody(t, body); body.dataset.rendered = "1"; }
    body.hidden = !open; caret.textContent = open ? "▾" : "▸";
  }
  card._toggle = toggle;
  head.addEventListener("click", function () { toggle(); });
  head.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(); } });
  card.appendChild(head); card.appendChild(body);
  list.appendChild(card); cards.push(card);
});
if (!T.length) list.appendChild(el("p", "muted", "No trajectories in this report."));

var itSel = document.getElementById("iteration");
(D.iterations || []).concat(D.evals || []).forEach(function (i) { var o = el("option", null, i.it + " (" + i.shown + (i.shown < i.total ? " of " + i.total : "") + ")"); o.value = String(i.it); itSel.appendChild(o); });

function searchText(t) {
  if (t._text !== undefined) return t._text;
  var parts = [t.id, t.env, t.status, t.label || "", t.error || "", t.traceback || ""];
  t.prompt_msgs.forEach(function (m) { parts.push(m.content); });
  (t.turn_msgs || []).forEach(function (tm) { parts.push(tm.assistant); tm.calls.forEach(function (c) { parts.push(c.name || "", c.arguments || "", c.raw || ""); }); tm.obs.forEach(function (m) { parts.push(m.content); }); });
  var toks = []; for (var i = 0; i < t.resp.length; i++) toks.push(tokText(t.resp[i]));
  parts.push(toks.join(""));
  t._text = parts.join("\n").toLowerCase();
  return t._text;
}

function applyFilters() {
  var want = {};
  document.querySelectorAll(".status-cb").forEach(function (cb) { want[cb.value] = cb.checked; });
  var q = document.getElementById("search").value.trim().toLowerCase();
  var lo = parseFloat(document.getElementById("reward-min").value), hi = parseFloat(document.getElementById("reward-max").value);
  var it = itSel.value, shown = 0;
  cards.forEach(function (card) {
    var t = T[+card.dataset.idx];
    var ok = (want[t.status] !== false) && (it === "" || String(t.it) === it);
    if (ok && !isNaN(lo)) ok = typeof t.reward === "number" && t.reward >= lo;
    if (ok && !isNaN(hi)) ok = typeof t.reward === "number" && t.reward <= hi;
    if (ok && q) ok = searchText(t).indexOf(q) >= 0;
    card.classList.toggle("hidden", !ok);
    if (ok) shown++;
  });
  document.getElementById("count").textContent = shown + " of " + T.length + " shown";
}
function only(status) { document.querySelectorAll(".status-cb").forEach(function (cb) { cb.checked = cb.value === status; }); applyFilters(); }

var timer = null;
document.getElementById("search").addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(applyFilters, 150); });
["reward-min", "reward-max"].forEach(function (id) { document.getElementById(id).addEventListener("input", applyFilters); });
itSel.addEventListener("change", applyFilters);
document.querySelectorAll(".status-cb").forEach(function (cb) { cb.addEventListener("change", applyFilters); });
document.getElementById("failed-only").addEventListener("click", function () { only("failed"); });
document.getElementById("truncated-only").addEventListener("click", function () { only("truncated"); });
document.getElementById("reset").addEventListener("click", function () {
  document.querySelectorAll(".status-cb").forEach(function (cb) { cb.checked = true; });
  ["search", "reward-min", "reward-max"].forEach(function (id) { document.getElementById(id).value = ""; });
  itSel.value = ""; applyFilters();
});
document.getElementById("expand-all").addEventListener("click", function () {
  cards.filter(function (c) { return !c.classList.contains("hidden"); }).slice(0, 50).forEach(function (c) { c._toggle(true); });
});
document.getElementById("collapse-all").addEventListener("click", function () { cards.forEach(function (c) { c._toggle(false); }); });
document.querySelectorAll(".it-link").forEach(function (b) {
  b.addEventListener("click", function () { itSel.value = b.dataset.it; applyFilters(); document.getElementById("trajectories").scrollIntoView(); });
});

// Shade trained tokens by probability: likely = light blue, unlikely = deep pink (never the
// amber of masked tokens).
function shade(root, on) {
  root.querySelectorAll(".tok.m1").forEach(function (s) {
    if (!on || s.dataset.lp === undefined) { s.style.background = ""; return; }
    var p = Math.exp(parseFloat(s.dataset.lp));
    s.style.background = "hsl(" + Math.round(330 - 110 * p) + ", 90%, " + Math.round(88 - 18 * (1 - p)) + "%)";
  });
}
document.getElementById("shade").addEventListener("change", function (e) {
  shade(document, e.target.checked);
  document.getElementById("shade-key").hidden = !e.target.checked;
});

applyFilters();
if (cards.length) cards[0]._toggle(true);  // one trajectory open, so the page shows what a trajectory looks like
document.body.dataset.ready = "1";
})();
