// kvreplay's report pages: draws the data the page carries as JSON
// (#kvreplay-data) with Plotly. Every value from a trace or a store goes onto the
// page as text (textContent), never as markup, and links only to relative or http(s)
// places.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("kvreplay-data").textContent);
  const app = document.getElementById("app");
  const COLORS = { full: "#1f77b4", swa: "#ff7f0e", pool: "#2ca02c" };
  const RUN_DASH = ["solid", "dash"];
  const SPARSE_MARKS = 1500; // a row with more findings is drawn as a strip of bins
  const STRIP_BINS = 2000;
  const VERDICT = { good: "#2ca02c", bad: "#d62728", skip: "#9e9e9e", fixed: "#1f77b4" };

  function safeHref(h) {
    h = String(h || "");
    if (/^[a-z][a-z0-9+.-]*:/i.test(h) && !/^https?:/i.test(h)) return "#";
    return h;
  }

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k === "href") e.setAttribute("href", safeHref(v));
      else if (k.startsWith("data-") || k === "id" || k === "title" || k === "type") e.setAttribute(k, v);
      else if (k === "onclick") e.addEventListener("click", v);
      else e[k] = v;
    }
    for (const kid of kids) {
      if (kid === undefined || kid === null) continue;
      e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return e;
  }

  // Plotly draws its text fields (names, labels, category ticks, annotations, hover
  // text) as a subset of HTML: links, styles. Everything from data goes in escaped, and
  // Plotly shows the entities as the characters they stand for.
  function P(v) {
    return String(v).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function text(v) {
    if (v === null || v === undefined) return "-";
    if (Array.isArray(v)) return "[" + v.map(text).join(", ") + "]";
    if (typeof v === "object") return "{" + Object.entries(v).map(([k, x]) => k + ": " + text(x)).join(", ") + "}";
    return String(v);
  }

  function table(head, rows, cls) {
    const t = el("table", { class: cls || "" });
    if (head) t.append(el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))));
    const body = el("tbody");
    for (const r of rows) body.append(r instanceof Node ? r : el("tr", {}, ...r.map((c) => el("td", {}, c instanceof Node ? c : text(c)))));
    t.append(body);
    return t;
  }

  function notes(list) {
    if (!list || !list.length) return null;
    return el("div", { class: "notes", id: "notes" }, ...list.map((n) => el("p", {}, n)));
  }

  // ---- runs: occupancy, findings, the detail of one -------------------------------

  function sameSeries(a, b) {
    if (!a || !b || a.length !== b.length) return false;
    for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
    return true;
  }

  function rgba(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${(n >> 16) & 255},${(n >> 8) & 255},${n & 255},${alpha})`;
  }

  function findingLabel(run, group, key, many) {
    const g = group === "violation" ? key : "divergence: " + key;
    return many ? run.label.split(":")[0] + " " + g : g;
  }

  function drawRuns(div, runs, recorded, onPick) {
    const traces = [];
    const shapes = [];
    const annotations = [];
    const many = runs.length > 1;
    const seenSizes = {};
    runs.forEach((run, ri) => {
      const occ = run.occupancy;
      if (!occ) return;
      for (const sub of Object.keys(occ.hi)) {
        const color = COLORS[sub] || "#555";
        const x = occ.hi[sub].map((_, i) => i * occ.stride + 1);
        const name = P((many ? run.label + ": " : "") + sub + " used" + (recorded ? " (replayed)" : ""));
        traces.push({ x, y: occ.hi[sub], name, mode: "lines", line: { color, width: 1.5, dash: RUN_DASH[ri % 2] },
          legendgroup: ri + sub, connectgaps: true, hovertemplate: "call %{x}: %{y} tokens used (highest)<extra>" + name + "</extra>" });
        traces.push({ x, y: occ.lo[sub], name: name + " (lowest)", mode: "lines", fill: "tonexty",
          fillcolor: rgba(color, many ? 0.12 : 0.25), line: { width: 0, color }, showlegend: false,
          legendgroup: ri + sub, connectgaps: true, hovertemplate: "call %{x}: %{y} tokens used (lowest)<extra></extra>" });
        if (!seenSizes[sub]) {
          seenSizes[sub] = 1;
          shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: occ.sizes[sub], y1: occ.sizes[sub],
            line: { color, width: 1, dash: "dot" } });
          annotations.push({ xref: "paper", x: 0, xanchor: "left", yref: "y", y: occ.sizes[sub], yanchor: "bottom",
            text: P(sub + " size " + occ.sizes[sub]), showarrow: false, font: { size: 10, color } });
        }
      }
      if (run.capacity_call) {
        shapes.push({ type: "line", x0: run.capacity_call, x1: run.capacity_call, yref: "paper", y0: 0, y1: 1,
          line: { color: "#d62728", width: 2 } });
        annotations.push({ x: run.capacity_call, yref: "paper", y: 1, yanchor: "bottom", showarrow: false,
          text: "an available count exceeds its size (call " + run.capacity_call + ")", font: { color: "#d62728", size: 11 } });
      }
    });
    const recordedNote = [];
    if (recorded) {
      const base = runs.find((r) => r.occupancy);
      for (const sub of Object.keys(recorded.hi)) {
        const same = base && base.occupancy.stride === recorded.stride && sameSeries(base.occupancy.hi[sub], recorded.hi[sub]) && sameSeries(base.occupancy.lo[sub], recorded.lo[sub]);
        if (same && !many) { recordedNote.push(sub); continue; }
        const x = recorded.hi[sub].map((_, i) => i * recorded.stride + 1);
        traces.push({ x, y: recorded.hi[sub], name: P(sub + " used (recorded)"), mode: "lines", connectgaps: true,
          line: { color: "#222", width: 1, dash: "dot" }, hovertemplate: "call %{x}: %{y} tokens used, recorded<extra></extra>" });
        if (!Object.keys(seenSizes).length) {
          shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: recorded.sizes[sub], y1: recorded.sizes[sub], line: { color: "#222", width: 1, dash: "dot" } });
        }
      }
    }
    // Findings: one row per rule (or divergence kind). Sparse rows draw a mark at each
    // finding's call. Dense rows (a bug that fires on every call) would be tens of
    // thousands of SVG marks, seconds to draw, and more marks than the chart has
    // pixels: they are drawn as a strip of bins instead, each bin coloured when a
    // finding falls in it and placed exactly by the data, which a click reads back.
    const rows = [];
    const span = Math.max(1, ...runs.map((r) => r.calls || 0), ...runs.flatMap((r) => Object.values(r.marks || {}).flatMap((g) => Object.values(g).map((c) => c[c.length - 1] || 0))));
    const width = Math.max(1, Math.ceil(span / STRIP_BINS));
    // One heatmap for every strip (Plotly cannot stack two on one category axis):
    // violations count up (red), divergences down (purple).
    const strip = { y: [], z: [], first: [] };
    runs.forEach((run, ri) => {
      for (const group of ["violation", "divergence"]) {
        const marks = (run.marks || {})[group] || {};
        for (const key of Object.keys(marks).sort()) {
          const label = P(findingLabel(run, group, key, many));
          rows.push(label);
          const calls = marks[key];
          if (calls.length > SPARSE_MARKS) {
            const n = Math.ceil(span / width) + 1;
            const sign = group === "violation" ? 1 : -1;
            const z = new Array(n).fill(null), first = new Array(n).fill(null);
            for (const c of calls) {
              const b = Math.floor((c - 1) / width);
              z[b] = (z[b] || 0) + sign;
              if (first[b] === null) first[b] = [ri, group, key, c, 0];
              first[b][4] += 1;
            }
            strip.y.push(label);
            strip.z.push(z);
            strip.first.push(first);
          } else {
            traces.push({ x: calls, y: calls.map(() => label), yaxis: "y2", mode: "markers", type: "scatter",
              name: label, showlegend: false, customdata: calls.map((c) => [ri, group, key, c]),
              marker: { size: 6, color: group === "violation" ? "#d62728" : "#9467bd", opacity: 0.55, symbol: "line-ns-open" },
              hovertemplate: "call %{x}<extra>" + label + "</extra>" });
          }
        }
      }
    });
    if (strip.y.length) {
      // The heatmap spans every row of the axis, sparse rows empty: Plotly sizes a
      // heatmap by its category axis, and a row it lacks would break it.
      const top = Math.max(2, ...strip.z.map((r) => Math.max(...r.map((v) => Math.abs(v || 0)))));
      const at = Object.fromEntries(strip.y.map((label, i) => [label, i]));
      const empty = strip.z[0].map(() => null);
      traces.push({ type: "heatmap", x: strip.z[0].map((_, b) => b * width + 1 + (width - 1) / 2), y: rows,
        z: rows.map((label) => label in at ? strip.z[at[label]] : empty), yaxis: "y2",
        customdata: rows.map((label) => label in at ? strip.first[at[label]] : empty), showscale: false, zmin: -top, zmax: top, zmid: 0,
        colorscale: [[0, "#3f1f66"], [0.499, "#c9b3e0"], [0.5, "#ffffff"], [0.501, "#f4a3a3"], [1, "#8b0000"]],
        ygap: 3, hoverongaps: false,
        hovertemplate: "%{customdata[4]} finding(s) in calls %{x} +/- " + Math.floor(width / 2) + ", the first at #%{customdata[3]}<extra>%{y}</extra>" });
    }
    runs.forEach((run, ri) => {
      for (const group of ["violation", "divergence"]) {
        for (const key of Object.keys((run.marks || {})[group] || {}).sort()) {
          const label = P(findingLabel(run, group, key, many));
          const calls = run.marks[group][key];
          const fi = run.firsts[group + ":" + key];
          const first = fi === undefined ? calls[0] : run.findings[fi].call;
          traces.push({ x: [first], y: [label], yaxis: "y2", mode: "markers", type: "scatter", showlegend: false,
            name: "first " + label, customdata: [[ri, group, key, first]],
            marker: { size: 15, color: "#ffd700", line: { color: "#000", width: 1.5 }, symbol: "star" },
            hovertemplate: "first: call %{x}<extra>" + label + "</extra>" });
        }
      }
    });
    const hasRows = rows.length > 0;
    // First findings that crowd the start of a long axis would sit on top of each other:
    // the chart opens zoomed on them (a double-click shows every call).
    const firstCalls = runs.flatMap((run) => Object.values(run.firsts).map((i) => run.findings[i].call));
    let zoomTo = null;
    if (firstCalls.length > 1 && span > 200) {
      const far = Math.max(...firstCalls);
      const near = Math.min(...firstCalls);
      if (far < span * 0.2 && (far - near) < span * 0.05) zoomTo = Math.min(span, Math.ceil(far * 1.25 + 20));
    }
    if (zoomTo) div.setAttribute("data-zoom", String(zoomTo));
    const layout = {
      height: hasRows ? 460 + 22 * rows.length : 440,
      margin: { l: 70, r: 20, t: 40, b: 50 },
      hovermode: "closest",
      // Below the chart: above it, a legend of many runs ran under the toolbar at the top right.
      legend: { orientation: "h", x: 0, xanchor: "left", y: -0.12, yanchor: "top" },
      xaxis: { title: { text: "call" }, zeroline: false, anchor: hasRows ? "y2" : "y", ...(zoomTo ? { range: [0, zoomTo] } : {}) },
      yaxis: { title: { text: "tokens in use (size - available)" }, domain: hasRows ? [Math.min(0.55, 0.12 + 0.05 * rows.length), 1] : [0, 1], rangemode: "tozero" },
      shapes, annotations,
    };
    if (hasRows) {
      layout.yaxis2 = { domain: [0, Math.min(0.45, 0.05 * rows.length + 0.02)], type: "category", automargin: true,
        categoryorder: "array", categoryarray: rows.slice().reverse(), fixedrange: true };
    }
    return Plotly.newPlot(div, traces, layout, { responsive: true, displaylogo: false, displayModeBar: "hover" }).then(() => {
      div.setAttribute("data-drawn", "1");
      div.setAttribute("data-ms", String(Math.round(performance.now())));
      div.on("plotly_click", (ev) => {
        const p = ev.points && ev.points[0];
        const cd = p && p.customdata;
        if (cd && cd.length >= 4) onPick(cd[0], cd[1], cd[2], cd[3]);
      });
      return recordedNote;
    });
  }

  function contextTable(contexts, around, call, detected) {
    // The state-changing calls before and after the call that made the state and the one
    // that revealed it (counter reads left out), as the report's gatherer chose them.
    const wanted = [...new Set([...(around[String(call)] || []), ...(around[String(detected)] || [])])].sort((a, b) => a - b);
    const rows = [];
    let prev = null;
    for (const n of wanted) {
      const c = contexts[String(n)];
      if (!c) continue;
      if (prev !== null && n > prev + 1) {
        rows.push(el("tr", { class: "gap" }, el("td", { colSpan: 5 }, (n - prev - 1) + " call(s) between, counter reads or further away")));
      }
      prev = n;
      const args = Object.entries(c.args).map(([k, v]) => k + "=" + text(v)).join(", ");
      const role = n === call ? "made the state" : n === detected ? "revealed it" : "";
      const tr = el("tr", { class: n === call ? "here" : n === detected ? "seen" : "" },
        el("td", { class: "ident" }, "#" + n), el("td", { class: "ident" }, c.method + (role ? " (" + role + ")" : "")),
        el("td", { class: "args" }, args),
        el("td", {}, c.exc ? "raised " + c.exc : text(c.result)),
        el("td", {}, Object.entries(c.counters).map(([k, v]) => k + " " + v).join(", ")));
      rows.push(tr);
    }
    if (!rows.length) return el("p", { class: "muted" }, "The calls around it are not in this report (the trace could not be read).");
    return table(["call", "method", "arguments", "result", "counters after"], rows, "context");
  }

  function findingBody(run, runs, group, key, call) {
    const f = run.findings.find((x) => x.group === group && x.key === key && x.call === call);
    const parts = [];
    if (!f) {
      parts.push(el("p", {}, "Only the first findings of each rule are kept whole; this one is counted and placed, its details are not kept."));
    } else {
      const facts = [["call", "#" + f.call + " " + f.method]];
      if (group === "violation") {
        const dist = f.detected_call - f.call;
        facts.push(["created by", "call #" + f.call + " (" + f.method + "): the state this violation trips on was made here"]);
        facts.push(["detected", dist > 0 ? "at call #" + f.detected_call + ", " + dist + " call(s) later (detection distance " + dist + ")" : "at the same call (detection distance 0)"]);
        facts.push(["sub-pool", f.sub_pool]);
        facts.push(["slots", text(f.indices)]);
      } else {
        facts.push(["expected", text(f.expected)]);
        facts.push(["got", text(f.actual)]);
      }
      facts.push(["message", f.message]);
      parts.push(table(null, facts, "facts"));
    }
    parts.push(el("h4", {}, "The calls around it"));
    parts.push(contextTable(data.contexts || {}, data.around || {}, call, f ? f.detected_call : call));
    return parts;
  }

  function showFinding(detail, runs, ri, group, key, call) {
    const run = runs[ri];
    detail.replaceChildren();
    const label = group === "violation" ? key : "divergence " + key;
    detail.append(el("h3", {}, label + " at call #" + call + (runs.length > 1 ? " (" + run.label + ")" : "")));
    detail.append(...findingBody(run, runs, group, key, call));
    detail.setAttribute("data-call", String(call));
    detail.scrollIntoView({ block: "nearest" });
  }

  function verdict(run) {
    // The answer first: what the run found, and where it started.
    const v = Object.values(run.counts.violation || {}).reduce((a, b) => a + b, 0);
    const d = Object.values(run.counts.divergence || {}).reduce((a, b) => a + b, 0);
    const rules = Object.keys(run.firsts).length;
    const firsts = Object.values(run.firsts).map((i) => run.findings[i]).sort((a, b) => a.call - b.call);
    const p = el("p", { class: "verdict status-" + run.status, id: "verdict" }, run.status + ": ");
    const ident = (t) => el("span", { class: "ident" }, t);
    if (!rules) p.append("no violation and no divergence in " + run.calls + " calls.");
    else {
      p.append(rules + " rule(s) broken (" + v + " violation(s), " + d + " divergence(s)) in " + run.calls + " calls; the first at call ",
        ident("#" + firsts[0].call), ", ", ident(firsts[0].method), ": ",
        ident(firsts[0].group === "violation" ? firsts[0].key : "divergence " + firsts[0].key), ".");
    }
    if (run.capacity_call) p.append(" An available count exceeds its pool's size from call ", ident("#" + run.capacity_call), ".");
    return p;
  }

  function openedFirsts(runs) {
    // The first finding of each rule, opened: the call that made the state, the one that
    // revealed it, and the state-changing calls around them.
    const box = el("div", { id: "firsts-open" });
    runs.forEach((run) => {
      const firsts = Object.values(run.firsts).map((i) => run.findings[i]).sort((a, b) => a.call - b.call);
      for (const f of firsts) {
        const label = (f.group === "violation" ? f.key : "divergence " + f.key) + " at call #" + f.call;
        box.append(el("details", { class: "finding", open: true, "data-key": f.key, "data-call": String(f.call) },
          el("summary", {}, label + (runs.length > 1 ? " (" + run.label + ")" : "")), ...findingBody(run, runs, f.group, f.key, f.call)));
      }
    });
    return box;
  }

  function firstsTable(runs, pick) {
    const rows = [];
    runs.forEach((run, ri) => {
      const order = Object.entries(run.firsts).sort((a, b) => run.findings[a[1]].call - run.findings[b[1]].call);
      for (const [k, fi] of order) {
        const f = run.findings[fi];
        const [group, key] = [f.group, f.key];
        const count = (run.counts[group] || {})[key];
        const btn = el("button", { class: "first", type: "button", "data-key": key, "data-group": group, "data-call": String(f.call),
          onclick: () => pick(ri, group, key, f.call) }, "show");
        rows.push(el("tr", {}, ...(runs.length > 1 ? [el("td", {}, run.label)] : []), el("td", {}, group), el("td", {}, key),
          el("td", {}, text(count)), el("td", {}, "#" + f.call), el("td", {}, f.method), el("td", {}, btn)));
      }
    });
    if (!rows.length) return el("p", { class: "clean" }, "No violation and no divergence.");
    const head = [...(runs.length > 1 ? ["run"] : []), "kind", "rule", "count", "first at", "method", ""];
    return table(head, rows, "firsts");
  }

  function renderRuns() {
    const runs = data.runs;
    const single = runs.length === 1 && data.kind === "run";
    app.append(el("h1", {}, data.title));
    const n = notes(data.notes);
    if (n) app.append(n);
    if (single) app.append(verdict(runs[0]));
    if (data.summary) app.append(table(null, data.summary, "meta"));
    const metas = el("div", { class: "metas" });
    for (const run of runs) {
      const box = el("div", { class: "meta-box status-" + run.status }, runs.length > 1 ? el("h3", {}, run.label) : null, table(null, run.meta, "meta"));
      metas.append(box);
    }
    const detail = el("div", { id: "detail", class: "detail" }, el("p", { class: "muted" }, "Click a finding (a mark on the chart or a row above) to see its call, its arguments and the calls around it."));
    const pick = (ri, g, k, c) => showFinding(detail, runs, ri, g, k, c);
    const firsts = firstsTable(runs, pick);
    const chart = el("div", { id: "chart", class: "chart" });
    const legendNote = el("p", { class: "muted", id: "chart-note" });
    if (single) {
      // A run's page opens on its answer: the verdict, the first of each rule opened,
      // then the picture, then the run's facts.
      app.append(el("h2", {}, "First of each rule"), firsts);
      if (Object.keys(runs[0].firsts).length) app.append(openedFirsts(runs));
      app.append(el("h2", {}, "Occupancy and findings over the calls"), chart, legendNote);
      app.append(el("h2", {}, "Detail"), detail);
      app.append(el("h2", {}, "The run"), metas);
    } else {
      if (data.kind !== "diff") app.append(metas);
      app.append(el("h2", {}, "Occupancy and findings over the calls"), chart, legendNote);
      app.append(el("h2", {}, "First of each rule"), firsts);
      app.append(el("h2", {}, "Detail"), detail);
    }
    const capped = runs.flatMap((r) => r.capped);
    if (capped.length) legendNote.append("Only the first 50,000 findings of " + capped.join(", ") + " are placed. ");
    drawRuns(chart, runs, data.recorded, pick).then((same) => {
      if (same.length) legendNote.append("The recorded occupancy of " + same.join(", ") + " equals the replayed one. ");
      legendNote.append("Bands: lowest to highest use in each bucket of calls; stars: the first finding of each rule.");
      const zoom = chart.getAttribute("data-zoom");
      if (zoom) legendNote.append(" Zoomed on the first findings (calls 1 to " + zoom + "); double-click the chart for all calls.");
    });
  }

  // ---- matrix, bisect, ci ----------------------------------------------------------

  function renderMatrix() {
    const m = data.matrix;
    app.append(el("h1", {}, data.title));
    const rules = new Set();
    for (const c of m.cells) { Object.keys(c.rules || {}).forEach((r) => rules.add(r)); Object.keys(c.divergences || {}).forEach((k) => rules.add("divergence: " + k)); }
    const cols = [...rules].sort();
    const many = m.traces.length > 1;
    const rowLabel = (c) => (many ? c.trace.split("/").pop() + " x " : "") + c.build;
    const z = [], txt = [], ylab = [], ids = [];
    for (const c of m.cells) {
      ylab.push(P(rowLabel(c) + " [" + c.status + "]"));
      ids.push(c.run_id);
      const untestable = ["unloadable", "unsupported", "crashed", "timeout"].includes(c.status);
      z.push(cols.map((r) => untestable ? null : (r.startsWith("divergence: ") ? ((c.divergences || {})[r.slice(12)] ? 1 : 0) : ((c.rules || {})[r] !== undefined ? 1 : 0))));
      txt.push(cols.map((r) => r.startsWith("divergence: ") ? ((c.divergences || {})[r.slice(12)] ? (c.divergences[r.slice(12)] + " divergence(s)") : "") : ((c.rules || {})[r] !== undefined ? "first at call #" + c.rules[r] : "")));
    }
    const chart = el("div", { id: "chart", class: "chart" });
    app.append(el("h2", {}, "Build x rule"), chart);
    if (cols.length) {
      Plotly.newPlot(chart, [{ type: "heatmap", x: cols.map(P), y: ylab, z, text: txt, customdata: ids.map((id) => cols.map(() => id)),
        hovertemplate: "%{y}<br>%{x}: %{text}<extra></extra>", colorscale: [[0, "#e8f5e9"], [1, "#d62728"]], showscale: false, xgap: 2, ygap: 2 }],
        { height: 160 + 34 * ylab.length, margin: { l: 260, b: 160, t: 20 }, yaxis: { autorange: "reversed" } }, { displaylogo: false, responsive: true }).then(() => {
        chart.setAttribute("data-drawn", "1");
        chart.on("plotly_click", (ev) => { const id = ev.points[0].customdata; if (data.links[String(id)]) window.location.href = safeHref(data.links[String(id)]); });
      });
    } else {
      chart.append(el("p", { class: "clean" }, "No build showed a violation or a divergence."));
      chart.setAttribute("data-drawn", "1");
    }
    app.append(el("h2", {}, "Runs"));
    app.append(table(["trace", "build", "status", "calls", "first findings", "report"], m.cells.map((c) => [
      c.trace, c.build, c.status, c.calls_replayed,
      Object.entries(c.rules || {}).map(([r, call]) => r + " #" + call).join(", ") || "-",
      data.links[String(c.run_id)] ? el("a", { href: data.links[String(c.run_id)] }, "run " + c.run_id) : "run " + c.run_id]), "runs"));
  }

  function renderBisect() {
    const b = data.bisect;
    app.append(el("h1", {}, data.title));
    const steps = (b.steps || []).slice().sort((x, y) => x.index - y.index);
    const cands = (b.candidates || []).map((c) => c.label);
    const summary = [["trace", b.trace], ["verdict", b.verdict], ["first bad", b.first_bad ? b.first_bad.label + " " + (b.first_bad.subject || "") : "-"],
      ["shows", b.bad_shows || "-"], ["builds in the search", b.searched], ["replays", b.replays]];
    app.append(table(null, summary, "meta"));
    const chart = el("div", { id: "chart", class: "chart" });
    app.append(el("h2", {}, "Builds in search order"), chart);
    Plotly.newPlot(chart, [{ type: "scatter", mode: "markers+text", x: steps.map((s) => s.index), y: steps.map(() => 0),
      text: steps.map((s) => P(s.label)), textposition: "top center", customdata: steps.map((s) => P(s.verdict + ": " + s.status + (s.why ? " (" + s.why + ")" : ""))),
      marker: { size: 18, color: steps.map((s) => VERDICT[s.verdict] || "#555"), line: { color: steps.map((s) => (b.first_bad && s.label === b.first_bad.label) ? "#000" : "#fff"), width: 3 } },
      hovertemplate: "%{text}<br>%{customdata}<extra></extra>" }],
      { height: 260, yaxis: { visible: false, range: [-1, 1.5] }, xaxis: { title: { text: "builds in search order, oldest first (the good end first)" }, zeroline: false, tickvals: steps.map((s) => s.index), ticktext: steps.map((s) => "#" + (s.index + 1)) }, margin: { t: 20 } },
      { displaylogo: false, responsive: true }).then(() => chart.setAttribute("data-drawn", "1"));
    app.append(el("p", { class: "muted" }, "green: good, red: bad, grey: skipped (untestable), blue: fixed" + (cands.length > 1 ? "; the first bad is one of " + cands.join(", ") : "")));
    app.append(el("h2", {}, "Step log"));
    app.append(table(["#", "build", "verdict", "status", "why", "cached", "wall s"], (b.steps || []).map((s, i) =>
      el("tr", { class: "verdict-" + s.verdict }, ...[i + 1, s.label, s.verdict, s.status, s.why, s.cached ? "yes" : "", s.wall_s.toFixed(2)].map((v) => el("td", {}, text(v))))), "steps"));
  }

  function renderCi() {
    app.append(el("h1", {}, data.title));
    app.append(table(["trace", "status", "expected", "ok", "report"], data.ci.map((r) => el("tr", { class: r.ok ? "ok" : "bad" },
      el("td", {}, text(r.trace)), el("td", {}, text(r.status)), el("td", {}, text(r.expected)), el("td", {}, r.ok ? "yes" : "NO"),
      el("td", {}, data.links[r.trace] ? el("a", { href: data.links[r.trace] }, "report") : "-"))), "runs"));
  }

  function renderHistory() {
    // A trace's runs across builds, oldest first: one row per build, a mark per run
    // (its size: what it found), linking to the run's page.
    const runs = data.runs;
    const builds = [...new Set(runs.map((r) => r.build))];
    const color = { clean: "#2ca02c", violation: "#d62728", divergence: "#9467bd" };
    const chart = el("div", { id: "chart", class: "chart" });
    app.append(el("h2", {}, "Across builds"), chart);
    Plotly.newPlot(chart, [{ type: "scatter", mode: "markers", x: runs.map((r) => r.started_at), y: runs.map((r) => P(r.build)),
      customdata: runs.map((r) => r.run_id), text: runs.map((r) => P("run " + r.run_id + " (" + r.mode + "): " + r.status + ", " + r.violation_total + " violation(s), " + r.divergence_total + " divergence(s)")),
      marker: { size: runs.map((r) => 9 + Math.min(14, Math.log10(1 + r.violation_total + r.divergence_total) * 4)), color: runs.map((r) => color[r.status] || "#9e9e9e") },
      hovertemplate: "%{text}<extra></extra>" }],
      { height: 140 + 36 * builds.length, margin: { l: 240, t: 10, b: 50 }, xaxis: { title: { text: "stored" } },
        yaxis: { type: "category", categoryarray: builds.map(P), automargin: true } }, { displaylogo: false, responsive: true }).then(() => {
      chart.setAttribute("data-drawn", "1");
      chart.on("plotly_click", (ev) => { const id = ev.points[0].customdata; if (data.links[String(id)]) window.location.href = safeHref(data.links[String(id)]); });
    });
  }

  const kinds = { history: renderHistory, run: renderRuns, compare: renderRuns, diff: renderRuns, matrix: renderMatrix, bisect: renderBisect, ci: renderCi };
  (kinds[data.kind] || renderRuns)();
  const n = notes(["run", "compare", "diff", "history"].includes(data.kind) ? [] : data.notes);
  if (n) app.append(n);
})();
