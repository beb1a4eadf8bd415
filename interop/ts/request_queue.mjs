// A request stream for a Connect bidi call that the caller pushes frames into; end()
// half-closes it (the server then finishes what it owes and ends the call with OK).
export function requestQueue() {
  const items = [];
  let wake = null;
  let ended = false;
  return {
    push(frame) {
      items.push(frame);
      if (wake) wake();
    },
    end() {
      ended = true;
      if (wake) wake();
    },
    async *[Symbol.asyncIterator]() {
      for (;;) {
        if (items.length) {
          yield items.shift();
          continue;
        }
        if (ended) return;
        await new Promise((r) => (wake = r));
        wake = null;
      }
    },
  };
}
