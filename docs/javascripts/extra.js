// Long identifiers in table cells (test ids, dotted names, paths) may break after "_", "::",
// ".", "/" or "," instead of anywhere: a <wbr> after each, in cells' inline code only.
(function () {
  function breakable(code) {
    if (code.textContent.length < 28 || code.querySelector("wbr")) return;
    var parts = code.textContent.split(/(?<=::|[_./,])/);
    code.textContent = "";
    parts.forEach(function (part, i) {
      code.appendChild(document.createTextNode(part));
      if (i < parts.length - 1) code.appendChild(document.createElement("wbr"));
    });
  }
  function run() {
    document.querySelectorAll(".md-typeset table:not([class]) code").forEach(breakable);
  }
  if (typeof document$ !== "undefined") document$.subscribe(run);
  else document.addEventListener("DOMContentLoaded", run);
})();
