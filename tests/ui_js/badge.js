// Runs the fleet page's app.js against a stub DOM and a stream the test feeds by hand:
// prints the connection badge's text after each step, one JSON line per step.
"use strict";
const fs = require("fs");
const vm = require("vm");

function element() {
  const e = {
    hidden: false, className: "", textContent: "", value: "", dataset: {}, tBodies: [],
    append() {}, replaceChildren() {}, focus() {}, addEventListener() {},
  };
  e.tBodies = [e];
  return e;
}
const elements = new Map();
const document = {
  getElementById(id) {
    if (!elements.has(id)) elements.set(id, element());
    return elements.get(id);
  },
  createElement: element,
  createTextNode: (t) => ({ t }),
  createDocumentFragment: element,
  querySelectorAll: () => [],
  addEventListener() {},
};
let push = null; // hands the next chunk to the page's reader
const encoder = new TextEncoder();
const response = {
  ok: true,
  status: 200,
  body: { getReader: () => ({ read: () => new Promise((resolve) => { push = resolve; }) }) },
};
const context = {
  document, console, TextDecoder, TextEncoder, AbortController, performance, Date, JSON,
  sessionStorage: { getItem: () => null, removeItem() {}, setItem() {} },
  fetch: async () => response,
  setTimeout: () => 0, clearTimeout() {}, setInterval: () => 0,
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8") + "\nglobalThis.follow = follow;", context);
const badge = () => document.getElementById("connection").textContent;
const settle = () => new Promise((resolve) => setImmediate(resolve));

(async () => {
  context.follow();
  await settle();
  console.log(JSON.stringify({ step: "headers", badge: badge() }));
  push({ value: encoder.encode('{"keepalive": true, "version": 0}\n'), done: false });
  await settle();
  console.log(JSON.stringify({ step: "keepalive", badge: badge() }));
  const snapshot = { version: 1, recent: [], status: { models: [], nodes: [], replicas: [], guard: null } };
  push({ value: encoder.encode(JSON.stringify(snapshot) + "\n"), done: false });
  await settle();
  console.log(JSON.stringify({ step: "snapshot", badge: badge() }));
  process.exit(0);
})();
