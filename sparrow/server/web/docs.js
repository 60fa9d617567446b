// The API reference at /docs: /openapi.json rendered as a list. No third-party code; text is
// written with textContent only (the Content-Security-Policy allows no inline script either).
"use strict";

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function resolve(doc, schema, depth) {
  // inline #/components/schemas references, a few levels deep, for reading
  if (depth > 6 || schema === null || typeof schema !== "object") return schema;
  if (Array.isArray(schema)) return schema.map((s) => resolve(doc, s, depth + 1));
  if (typeof schema.$ref === "string" && schema.$ref.startsWith("#/components/schemas/")) {
    const name = schema.$ref.slice("#/components/schemas/".length);
    const target = (doc.components && doc.components.schemas || {})[name];
    return target ? Object.assign({ title: name }, resolve(doc, target, depth + 1)) : schema;
  }
  const out = {};
  for (const [k, v] of Object.entries(schema)) out[k] = resolve(doc, v, depth + 1);
  return out;
}

function render(doc) {
  const main = document.getElementById("ops");
  main.textContent = "";
  main.appendChild(el("p", "version", `${doc.info.title} ${doc.info.version}, OpenAPI ${doc.openapi}`));
  for (const [path, item] of Object.entries(doc.paths || {})) {
    for (const [method, op] of Object.entries(item)) {
      const sec = el("details", "op");
      const sum = el("summary");
      sum.appendChild(el("span", `method ${method}`, method.toUpperCase()));
      sum.appendChild(el("code", "path", path));
      sum.appendChild(el("span", "title", op.summary || ""));
      sec.appendChild(sum);
      if (op.description) sec.appendChild(el("p", "desc", op.description));
      const body = op.requestBody && op.requestBody.content && op.requestBody.content["application/json"];
      if (body && body.schema) {
        sec.appendChild(el("h3", "", "Request body"));
        sec.appendChild(el("pre", "", JSON.stringify(resolve(doc, body.schema, 0), null, 2)));
      }
      const codes = Object.entries(op.responses || {});
      if (codes.length) {
        sec.appendChild(el("h3", "", "Answers"));
        const ul = el("ul");
        for (const [code, r] of codes) ul.appendChild(el("li", "", `${code}: ${r.description || ""}`));
        sec.appendChild(ul);
      }
      main.appendChild(sec);
    }
  }
}

fetch("/openapi.json")
  .then((r) => r.json())
  .then(render)
  .catch((e) => { document.getElementById("status").textContent = `Could not read /openapi.json: ${e}`; });
